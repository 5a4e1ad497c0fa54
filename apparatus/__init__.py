"""The apparatus that several lessons share to show and prove what they teach: the layer above
common/ (it imports common/ and itself, nothing else of ours).

    ui.py           rank 0's voice, progress bars, tables, and step mode (--step)
    results.py      runs/lesson-NN/: final.pt and metrics.json, written beside then renamed
    comm.py         the one collective counter: every collective, its bytes, its phase
    memory.py       bytes of parameters, gradients, optimizer state and activations
    sharding.py     what a rank of a sharded job holds and sends (lessons 15, 16, 19)
    state_dicts.py  loading a state_dict across wrappers (lesson 09's lesson, used since)

What serves one lesson only lives in that lesson's folder (lessons/NN_topic/), beside it.
"""
