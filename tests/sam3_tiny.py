"""A small random SAM 3 image model built from the `sam3` package's own classes (its builder makes only the
848M-parameter model, and on CUDA only): the released architecture with fewer and narrower layers, a
112-px input (8 x 8 patches of 14), no box pooling in the geometry encoder (its `pin_memory()` needs CUDA)
and no precomputed position or coordinate caches (built on CUDA)."""

from __future__ import annotations

import torch
import torch.nn as nn

RESOLUTION = 112


def tiny_sam3_model(seed: int = 0) -> nn.Module:
    from sam3.model.decoder import TransformerDecoder, TransformerDecoderLayer
    from sam3.model.encoder import TransformerEncoderFusion, TransformerEncoderLayer
    from sam3.model.geometry_encoders import SequenceGeometryEncoder
    from sam3.model.maskformer_segmentation import PixelDecoder, UniversalSegmentationHead
    from sam3.model.model_misc import MLP, DotProductScoring, TransformerWrapper
    from sam3.model.model_misc import MultiheadAttentionWrapper as MHA
    from sam3.model.necks import Sam3DualViTDetNeck
    from sam3.model.position_encoding import PositionEmbeddingSine
    from sam3.model.sam3_image import Sam3Image
    from sam3.model.text_encoder_ve import VETextEncoder
    from sam3.model.tokenizer_ve import SimpleTokenizer
    from sam3.model.vitdet import ViT
    from sam3.model.vl_combiner import SAM3VLBackbone

    from clipseg_sparse.models.sam3.common import clip_bpe_path
    from clipseg_sparse.models.sam3.package import init_unloaded

    D = 256  # the heads' width is fixed in the package's modules
    torch.manual_seed(seed)

    def pos():
        return PositionEmbeddingSine(num_pos_feats=D, normalize=True, scale=None, temperature=10000)

    def mha(batch_first=None):
        kw = dict(num_heads=8, dropout=0.0, embed_dim=D)
        return MHA(**kw) if batch_first is None else MHA(batch_first=batch_first, **kw)

    def enc_layer(**kw):
        return TransformerEncoderLayer(activation="relu", d_model=D, dim_feedforward=64, dropout=0.0, pre_norm=True, **kw)

    vit = ViT(
        img_size=RESOLUTION, pretrain_img_size=56, patch_size=14, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2,
        norm_layer="LayerNorm", qkv_bias=True, use_abs_pos=True, tile_abs_pos=True, global_att_blocks=(1,), rel_pos_blocks=(),
        use_rope=True, use_interp_rope=True, window_size=4, pretrain_use_cls_token=True, retain_cls_token=False, ln_pre=True,
        ln_post=False, return_interm_layers=False, bias_patch_embed=False, use_act_checkpoint=False,
    )
    neck = Sam3DualViTDetNeck(position_encoding=pos(), d_model=D, scale_factors=[4.0, 2.0, 1.0, 0.5], trunk=vit, add_sam2_neck=False)
    text = VETextEncoder(tokenizer=SimpleTokenizer(bpe_path=clip_bpe_path()), d_model=D, width=64, heads=2, layers=1)
    encoder = TransformerEncoderFusion(
        layer=enc_layer(pos_enc_at_attn=True, pos_enc_at_cross_attn_keys=False, pos_enc_at_cross_attn_queries=False,
                        self_attention=mha(True), cross_attention=mha(True)),
        num_layers=1, d_model=D, num_feature_levels=1, frozen=False, use_act_checkpoint=False,
        add_pooled_text_to_img_feat=False, pool_text_with_mask=True,
    )
    decoder = TransformerDecoder(
        layer=TransformerDecoderLayer(activation="relu", d_model=D, dim_feedforward=64, dropout=0.0, cross_attention=mha(), n_heads=8,
                                      use_text_cross_attention=True),
        num_layers=1, num_queries=10, return_intermediate=True, box_refine=True, num_o2m_queries=0, dac=True, boxRPB="log",
        d_model=D, frozen=False, interaction_layer=None, dac_use_selfatt_ln=True, resolution=None, stride=None,
        use_act_checkpoint=False, presence_token=True,
    )
    scoring = DotProductScoring(
        d_model=D, d_proj=D,
        prompt_mlp=MLP(input_dim=D, hidden_dim=64, output_dim=D, num_layers=2, dropout=0.0, residual=True, out_norm=nn.LayerNorm(D)),
    )
    head = UniversalSegmentationHead(
        hidden_dim=D, upsampling_stages=3, aux_masks=False, presence_head=False, dot_product_scorer=None, act_ckpt=False,
        cross_attend_prompt=mha(), pixel_decoder=PixelDecoder(num_upsampling_stages=3, interpolation_mode="nearest", hidden_dim=D),
    )
    geometry = SequenceGeometryEncoder(
        pos_enc=pos(), encode_boxes_as_points=False, points_direct_project=True, points_pool=True, points_pos_enc=True,
        boxes_direct_project=True, boxes_pool=False, boxes_pos_enc=True, d_model=D, num_layers=1,
        layer=enc_layer(pos_enc_at_attn=False, pos_enc_at_cross_attn_queries=False, pos_enc_at_cross_attn_keys=True,
                        self_attention=mha(False), cross_attention=mha(False)),
        use_act_ckpt=False, add_cls=True, add_post_encode_proj=True,
    )
    model = Sam3Image(
        backbone=SAM3VLBackbone(visual=neck, text=text, scalp=1), transformer=TransformerWrapper(encoder=encoder, decoder=decoder, d_model=D),
        input_geometry_encoder=geometry, segmentation_head=head, num_feature_levels=1, o2m_mask_predict=True, dot_prod_scoring=scoring,
        use_instance_query=False, multimask_output=True, inst_interactive_predictor=None, matcher=None,
    )
    return init_unloaded(model, seed).eval()


def tiny_hf_model(seed: int = 0, gain: float = 2.0, decoder_layers: int = 1):
    """A small random transformers `Sam3Model` (1.8M parameters, 112 px, 8 x 8 patches): ViT of 2 blocks
    (windowed, global), one fusion / decoder / geometry layer, 10 queries, a 1-layer CLIP text encoder on
    the real 49408-token vocabulary (decoder_layers: the DETR decoder's depth). PyTorch's default init per layer and every Linear outside the ViT
    times `gain`: transformers' own init (std 0.02) gives every prompt the same presence and no instance."""
    from transformers import Sam3Config, Sam3Model
    from transformers.models.sam3.configuration_sam3 import Sam3ViTConfig

    vit = Sam3ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=RESOLUTION,
                        patch_size=14, window_size=4, global_attn_indexes=[1], pretrain_image_size=56, layer_norm_eps=1e-5)  # fmt: skip
    sub = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64)
    config = Sam3Config(
        vision_config=dict(backbone_config=vit, fpn_hidden_size=32),
        text_config=dict(vocab_size=49408, hidden_size=32, intermediate_size=64, projection_dim=32, num_hidden_layers=1, num_attention_heads=2,
                         max_position_embeddings=32, hidden_act="gelu", layer_norm_eps=1e-5),  # fmt: skip
        geometry_encoder_config=dict(num_layers=1, **sub), detr_encoder_config=dict(num_layers=1, **sub),
        detr_decoder_config=dict(num_layers=decoder_layers, num_queries=10, **sub), mask_decoder_config=dict(hidden_size=32, num_attention_heads=2),
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Sam3Model(config)
    for module in model.modules():
        if module is not model and hasattr(module, "reset_parameters"):
            module.reset_parameters()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and not name.startswith("vision_encoder"):
                module.weight.mul_(gain)
    return model.eval()


def tiny_hf_prompter(precision: str = "fp32", decoder_layers: int = 1):
    from clipseg_sparse.models.sam3 import TransformersPrompter
    from clipseg_sparse.models.sam3.hf import offline_processor

    return TransformersPrompter(tiny_hf_model(decoder_layers=decoder_layers), offline_processor(RESOLUTION), "none", "cpu", precision)
