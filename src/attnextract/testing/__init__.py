"""Test boxes: black boxes just outside the model classes, for testing learners.

Nothing here is needed to extract a model. :mod:`attnextract.testing.impostors` holds
the impostor zoo the package's own tests and benchmarks run every learner against: each
impostor is an honest model of a class with one thing changed (a sliding window, a
second head, clipping at large outputs, a sink, a switch to another model after some
queries, ...), and a learner must refuse it (:class:`attnextract.ModelMismatchError`, or
a failed held-out check), never return it as a success. A learner of your own can face
the same zoo::

    import numpy as np
    from attnextract import ModelMismatchError, Oracle
    from attnextract.adapters.targets import random_single_head
    from attnextract.testing.impostors import make_impostor, zoo

    honest = random_single_head(8, seed=0)
    for name in zoo(honest):
        # recovery_queries: where the "switch" impostors change model (your learner's
        # query count on the honest box)
        box = make_impostor(name, honest, np.random.default_rng(1), recovery_queries=72)
        try:
            my_learner(Oracle(box, 8))
        except ModelMismatchError:
            continue                       # refused, as it must be
        print(f"{name} accepted: {box.reason}")

A few impostors fall back into the class for some draws (a second head that happens to
share the first one's scores is one head), so judge a learner over several seeds, as
:func:`attnextract.testing.impostors.run_impostor` does for the package's learners.
"""
