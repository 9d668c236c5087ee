"""The GPT that ds_recycle trains, as a list of DeepSpeed ``LayerSpec``s."""
from ds_recycle.model.gpt import Block, Embedding, Head, build_pipeline_module, gpt_layer_specs, gpt_loss_fn

__all__ = ["Block", "Embedding", "Head", "build_pipeline_module", "gpt_layer_specs", "gpt_loss_fn"]
