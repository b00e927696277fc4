"""batchd.worker: one process per device; the only place torch runs.

Started by the frontend's supervisor, or by hand for a remote host:

    batchd worker --connect tcp://HOST:PORT --device cuda:0 --model-repository DIR
"""


class InputRefused(ValueError):
    """Raise it from a model (its forward, or a step-wise model's `start`) to refuse
    the inputs it was given: the caller gets INVALID_ARGUMENT (HTTP 400) with its
    message, where any other exception is the model's failure (INTERNAL). A batch of
    several requests that raises it is retried request by request, so only the
    request at fault is refused. Importing it costs nothing: this package's
    `__init__` imports no torch.

        from batchd.worker import InputRefused
    """
