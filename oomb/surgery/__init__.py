"""Changes oomb makes to a transformers model before it trains, each a module of its own: liger's fused
ops swapped in (fused_ops), weight gradients added inside their matmuls (grad_accumulation), attention
heads split over GPUs (tensor_parallel), Linear layers in 4 bits (quantize), LoRA adapters as peft makes
them (adapters) and peft's LoRA layers with the adapter fused into the frozen matmul (lora). The step
(oomb.engine) runs whatever model these leave; none of them imports oomb."""

__all__: list[str] = []
