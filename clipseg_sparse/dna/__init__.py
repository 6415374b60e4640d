"""DnA (Denoising Attention), the trainable method: module, warm-start conversion, adapters, training, statistics.

    from clipseg_sparse.dna import DenoisingAttention, convert_to_dna, save_adapter, load_adapter, apply_adapter
    modules = convert_to_dna(clip, blocks=2, eps=1e-4)     # last 2 blocks; only Q-, V-, alpha trainable
    save_adapter(clip, "runs/dna/adapter.safetensors")

Training: `clipseg_sparse.dna.train.train(TrainConfig(...), out)`; statistics: `clipseg_sparse.dna.stats`.
"""

from .adapter import Adapter, AdapterError, apply_adapter, build_modules, check_compatible, load_adapter, save_adapter
from .convert import convert_to_dna, dna_modules, warm_start
from .module import DenoisingAttention

__all__ = [
    "Adapter", "AdapterError", "DenoisingAttention", "apply_adapter", "build_modules", "check_compatible",
    "convert_to_dna", "dna_modules", "load_adapter", "save_adapter", "warm_start",
]
