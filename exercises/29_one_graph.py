"""Exercise 29: one graph for every batch size (no recompiles).

A training job's last batch is often shorter than the others, and an evaluation may run other
sizes. Each new size fails the compiled graph's guard ("tensor 'x' size mismatch at index 0")
and dynamo compiles again (lesson 29, Step 4). The check calls

    run_batches(compiled, batches)

    compiled   lesson 13's transformer, compiled whole: torch.compile(model, backend=...)
               (nothing is compiled yet: dynamo runs at the first call)
    batches    token batches of 24, 16, 8 and 40 rows (32 tokens each), in this order

and wants back the outputs, one per batch, in order, each computed by `compiled`. Below, each
call compiles for its batch's size: the first graph is for 24 rows only, 16 rows recompile
(then dynamo makes that dimension dynamic). Make dynamo compile ONE graph, at the first call,
that serves every size, with no recompile; the outputs must stay the model's own.

Hint: docs/29_compile.md, Step 4 (a dimension can be marked dynamic before the first call).
Lesson 29's graph_census.new_shape does it: try it before you read it.

Check it:  make check-29   (counts the graphs and recompiles dynamo made, and the calls that ran
                            compiled code; compares the outputs with the model's, computed eagerly)
"""
import torch


def run_batches(compiled, batches):
    outputs = []
    for x in batches:
        # TODO: one graph for every batch size, compiled at the first call
        outputs.append(compiled(x))
    return outputs
