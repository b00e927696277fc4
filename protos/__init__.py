"""batchd's contracts: the Open Inference Protocol stubs, the datatype table,
the model repository format and the frontend<->worker wire format.

Imported by batchd.server, batchd.worker and batchd.client alike; imports
none of them, and never torch.
"""
