"""The small shared package behind the lessons. Read it in one sitting:

    cli.py          flags every lesson shares, one-line errors instead of tracebacks
    device.py       --device auto|cpu|cuda and the matching backend (nccl / gloo)
    distributed.py  free ports, process-group set-up with a timeout, clean teardown
    ui.py           rank-aware output with rich: steps, log lines, progress bars
    recipe.py       the shared training recipe: data, model, optimizer, sample order
    results.py      final.pt and metrics.json, written atomically, and comparisons
    checkpoint.py   load_into: load a state_dict saved from any wrapper into any wrapper
    datasets.py     MNIST and CIFAR-10 from torchvision's file layout (--dataset)
    nodes.py        simulate several machines: one torchrun agent per "node"

Each helper here first appears *inline* in a lesson that teaches it; later lessons
call the helper so that they can focus on their own new idea.
"""
