"""batchd.worker: one process per device; the only place torch runs.

Started by the frontend's supervisor, or by hand for a remote host:

    batchd worker --connect tcp://HOST:PORT --device cuda:0 --model-repository DIR
"""
