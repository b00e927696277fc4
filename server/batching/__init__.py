"""Dynamic batching: which requests ride together, when they leave, and how their
tensors become one batch's and come back apart.

    decision.py    decide(): send now or wait until when (pure)
    plan.py        plan_batch(): which queued requests form the next batch (pure)
    latency.py     the adaptive batch cap under target_latency_ms (pure)
    split_join.py  requests -> a batch's wire tensors -> one result per request (pure)
    scheduler.py   the bounded per-model queues and the shell that runs the above
"""
