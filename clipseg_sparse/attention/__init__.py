"""The attention spec: one value that describes every training-free edit of CLIP's last block(s).

A spec has score terms (which features are compared, how, and how the normalised maps are mixed), a row
*normalizer*, an optional neighbourhood *prior*, a temperature, the block mode (residual, FFN, how many
final blocks, parallel path, aggregation, extra inputs), an optional negative (DnA-style) branch and
the token stages it needs (`hook:`). Published methods are named presets (`clipseg_sparse.methods`).

Compact text form, used on the command line, in sweep grids, result files and table rows:

    TERMS/NORMALIZER[/OPTION...]
    TERMS       GROUP[+GROUP...]     each group normalised, then summed (SCLIP: qq+kk)
    GROUP       [W*]TERM             a weighted term
                [W*](TERM&TERM...)   scores (each [W*]TERM) summed before one normalizer
                id                   the value path only (MaskCLIP)
    TERM        TAP[MOD,MOD...]
    TAP         qk | qq | kk | vv    the edited block's projections (per head)
                x@L                  CLIP's hidden state after block L (1-based; one map for all heads)
                attn@A-B             mean of CLIP's own attention maps of blocks A..B (already normalised)
                ...                  more registered in `taps.TAPS` (e.g. external backbones)
    MOD         dot | cos            metric: a.b x temperature (default) or cosine
                temp:T | temp:auto   score scale (dot default 1/sqrt(d), cos default 1); auto = GEM's
                                     mean token norm of ln_1(x) x 1/sqrt(d)
                iter:N               GEM's clustering steps a <- normalize(norm(t a a^T) a)
                shift:BETA scale:G   S <- G * (S - BETA * mean(S))  (ProxyCLIP / SC-CLIP)
                pos | thresh:T | topk:K | topp:P   support: entries outside get -inf (probability 0)
                region:EPS           CorrCLIP's scope: same region, or either token unsegmented
                                     and S > mean(S); regions merged by DBSCAN (eps EPS) on the
                                     term's region-mean features; needs region maps per window
    NORMALIZER  softmax | entmax:ALPHA | sparsemax | randmask:ALPHA  (every normalizer slot)
    OPTION      gauss:SIGMA   NACLIP's Gaussian neighbourhood prior on the patch grid (added to logits)
                temp:T        score scale of dot terms (default 1/sqrt(head_dim))
                nores         drop the residual connection in the edited blocks
                cls:C         residual replaced by C x the input's CLS token; attention over patches only
                noffn         drop the FFN in the edited blocks
                layers:N      edit the last N blocks (default 1)
                parallel      the edited blocks form a side path reading the original path (GEM)
                avg           divide the sum over groups by their number
                neg:W         add W * softmin(S) V, the training-free negative branch of DnA
                aggin:TERM    aggregate the block input, x <- R(support(S)) x (identity values; R: rows
                              divided by their sum + 1e-6), e.g. x@9[cos,thresh:0.4] (SC-CLIP)
                aggout:TERM   the same on the block output
                in:[W*]sum@A-B | in:[W*]mean@A-B   also run the block on that input and add its output;
                              in:sum@A-B(GROUP+...) attends with its own score groups (SFP)
                hook:NAME     a token, match or global stage the method needs (`clipseg_sparse.stages`):
                              lof (SC-CLIP's outlier repair), surgery (CLIP Surgery's feature surgery),
                              sam (Trident's SAM stage over the spliced windows)
                mct:BETA      CorrCLIP's semantic branch: one CLS copy per region attends to the CLS and
                              its region's patches in every block; its last-block output, weight BETA,
                              goes to its region's patches; every branch (main, in:, semantic) then
                              passes ln_post on its own before the sum
                stitch:M      OV-Stitcher: windows zero-padded centred to a multiple of M and stitched onto
                              the image grid; the proxy's last block (`ext:NAME.out`), the in: blocks and
                              the region-scoped last-block map run over the whole image, a block of rows
                              at a time (`methods/ovstitcher.py`, the `stitched` forward)
                NAME:ARG      an option registered with `register_option` (extension point)

`str(spec)` writes the canonical form, and `AttentionSpec.parse(str(spec)) == spec`. Every option is
orthogonal to the normalizer: `-entmax` presets set entmax in every normalizer slot.
"""

from __future__ import annotations

from .blocks import EncoderState, edited_block_forward, encode_tokens
from .combine import _attend, aggregate, attention_weights
from .presets import list_presets, register_entmax_variant, register_preset, resolve_spec
from .stitched import blocked_attention, global_attention, stitch_multiple
from .spec import OPTIONS, PRESETS, AttentionSpec, Preset, register_option
from .terms import SOURCES, BlockInput, Group, Term
from .taps import TAPS, BlockContext, Tap
from .transforms import gaussian_prior


def attention_maps(clip, pixels, spec, regions=None, pos_interp: str = "size", context=None) -> "torch.Tensor":  # noqa: F821
    """B x H x N x N: the normalised attention that multiplies the values in the last edited block
    (main path), per head, computed by the forward's own score and normalize functions.

    clip: a DenseCLIP; pixels: B x 3 x H x W CLIP-normalised (sides multiples of the patch size);
    spec: a spec, its text or a preset name. N = 1 + h*w tokens (CLS first, then the patch grid
    row-major), or h*w with `cls:C`. Rows sum to 1 (to the sum of group weights with weights, plus W
    with `neg:W`); for source `id` the identity. regions: B x H x W region ids of the pixels, for specs
    with the `region:EPS` support (CorrCLIP). pos_interp: the positional-embedding rule ("size", or the
    published repositories' "scale"), as the protocol `eval` runs under gives it. context: as `encode_dense`'s
    (`image_features`: backbone name -> B x C x H x W whole-image features of the pixels, or the windows' crops
    of a raw map as `Segmenter` gives them, `models.proxies.WholeImageFeatures(raw_map, size).windows(boxes, pad)`,
    for CorrCLIPv2's `ext:NAME.image` taps).
    """
    return clip.attention_maps(pixels, spec, regions, pos_interp, context)


__all__ = [
    "AttentionSpec", "BlockContext", "BlockInput", "EncoderState", "Group", "OPTIONS", "PRESETS", "Preset",
    "SOURCES", "TAPS", "Tap", "Term", "_attend", "aggregate", "attention_maps", "attention_weights",
    "edited_block_forward", "encode_tokens", "gaussian_prior", "list_presets", "register_entmax_variant",
    "register_option", "register_preset", "resolve_spec", "blocked_attention", "global_attention", "stitch_multiple",
]
