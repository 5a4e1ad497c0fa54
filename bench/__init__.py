"""The benchmark suite: measured speedups and costs of the lessons' techniques (`make bench`).

    run.py      the command line: plans the runs, starts the ranks, writes results.json
    measure.py  what every rank runs: DDP throughput, bucketing, no_sync, all-reduce timings
    sharded_transformer.py  the transformer (Part 2's recipe) split across ranks: FSDP2 vs
                DDP, tensor parallel's collectives, pipeline schedules (measured on 1 and 2
                ranks; its tables and page sections 6-8 too)
    report.py   the tables (printed with rich, and reused by the doc) and the PNG plots
    doc.py      PERFORMANCE.md and zh/PERFORMANCE.md from results.json, every number and every
                sentence that interprets one (runs/bench/; docs/ only with make bench-docs)

Every number is the median of several timed repetitions after a warm-up, with the
min-max spread beside it; a repetition of a multi-rank benchmark lasts as long as its
slowest rank. The methods a section compares are timed in turn (A B, B A, A B, ...:
measure.Ctx.timed_in_turn), so a drift in the machine's speed touches them alike.
"""
