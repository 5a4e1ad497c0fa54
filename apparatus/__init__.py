"""The apparatus that proves what the lessons teach, kept out of the lesson files.

A lesson file tells one idea (../shared/STYLE.md); what only *measures* that idea (counting
bytes held per rank, counting collectives and the bytes they send, the memory table) lives here,
one small module per instrument, so the learner can read it when the doc sends them here.
"""
