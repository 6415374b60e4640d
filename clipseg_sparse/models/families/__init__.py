"""CLIP families, one file each: which open_clip configurations are of the family (`tower.register_family`)
and the `tower.Tower` its loaded models run through. `tower.FAMILIES` names these modules in match order.

- `openclip_vit`: open_clip's own VisionTransformer (CLIP ViT, MetaCLIP 2, ...), and the open_clip
  configurations refused outright (Hugging Face text encoders, CoCa, ResNet, CLIPA);
- `timm_tower`: the adapter that runs a timm image tower's blocks as the engine's, the timm towers refused
  (ViTamin, ConvNeXt, FastViT, MCi, Swin, relative positions), and any other timm ViT;
- `eva` (EVA-02, EVA-01), `pe_core` (PE-Core), `siglip` (SigLIP, SigLIP 2): timm towers through that adapter.

A new family is one more file here, named in `FAMILIES`' locations (or in a plug-in's entry-point module).
"""
