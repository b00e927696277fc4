"""ModelConfig (model.toml) -> ModelMetadataResponse / ModelConfigResponse. Pure."""

from __future__ import annotations

from batchd.protos import inference_pb2 as pb
from batchd.protos.datatypes import DATATYPES
from batchd.protos.model_config import AUTO_DELAY_MAX_US, ModelConfig


def model_metadata(cfg: ModelConfig) -> pb.ModelMetadataResponse:
    lead = [-1] if cfg.batches else []
    return pb.ModelMetadataResponse(
        name=cfg.name,
        versions=[cfg.version],
        platform=cfg.platform,
        inputs=[
            pb.TensorMetadata(name=t.name, datatype=t.datatype, shape=lead + list(t.shape))
            for t in cfg.inputs
        ],
        outputs=[
            pb.TensorMetadata(name=t.name, datatype=t.datatype, shape=lead + list(t.shape))
            for t in cfg.outputs
        ],
    )


def model_config(cfg: ModelConfig) -> pb.ModelConfigResponse:
    def enum(datatype: str) -> str:
        return str(pb.DataType.Name(DATATYPES[datatype].config_enum))

    return pb.ModelConfigResponse(
        config=pb.ModelConfig(
            name=cfg.name,
            platform=cfg.platform,
            backend="batchd",
            max_batch_size=cfg.max_batch_size,
            input=[
                pb.ModelInput(
                    name=t.name,
                    data_type=enum(t.datatype),
                    dims=t.shape,
                    allow_ragged_batch=t.ragged,
                )
                for t in cfg.inputs
            ],
            output=[
                pb.ModelOutput(name=t.name, data_type=enum(t.datatype), dims=t.shape)
                for t in cfg.outputs
            ],
            dynamic_batching=pb.ModelDynamicBatching(
                # automatic: its ceiling (the delay itself follows the arrival rate)
                max_queue_delay_microseconds=AUTO_DELAY_MAX_US
                if cfg.batching.max_queue_delay_us is None
                else cfg.batching.max_queue_delay_us,
                preferred_batch_size=cfg.batching.preferred_batch_sizes,
                priority_levels=cfg.batching.priority_levels,
                default_priority_level=cfg.batching.default_priority_level,
            )
            if cfg.batches
            else None,
            model_transaction_policy=pb.ModelTransactionPolicy(decoupled=cfg.generate is not None),
        )
    )
