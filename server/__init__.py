"""batchd.server: the asyncio gRPC frontend. Never imports torch.

batchd serve --model-repository DIR        (or: python -m batchd.server ...)
"""

__version__ = "0.1.0"
