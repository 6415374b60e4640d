"""The two baselines every table starts from: unmodified CLIP and MaskCLIP.

- `clip`: Radford et al., ICML 2021 (open_clip's forward, unchanged: `AttentionSpec()`).
- `maskclip`: Zhou et al., ECCV 2022 (chongzhou96/MaskCLIP@245d31f `mmseg/models/backbones/vit.py`): the last
  block's value path only (v -> out-proj, no q-k attention), residual and FFN kept. Not copied: its optional
  key smoothing and prompt denoising (both off by default there).

No protocol of their own (they run under any, e.g. `--protocol sclip`). Grid: `clip` is the source `qk` of
`sweeps/grids/sources-normalizers.toml`; `maskclip` has none.
"""

from __future__ import annotations

from ..attention.presets import register_preset

register_preset("clip", "qk/softmax", "unmodified CLIP (Radford et al., ICML 2021)")
register_preset(
    "maskclip",
    "id/softmax",
    "MaskCLIP (Zhou et al., ECCV 2022): last block uses the value path only (no q-k attention); "
    "residual and FFN kept",
)
