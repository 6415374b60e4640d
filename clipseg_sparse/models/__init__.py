"""The networks we load: CLIP (`load_clip`, `DenseCLIP`), its exact fast text tower, proxy backbones.

May import `attention`, `stages`, `runtime`; never `segment` or anything above it."""
