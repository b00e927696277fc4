"""batchd's private protobuf descriptor pool (see generate.py for why)."""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
