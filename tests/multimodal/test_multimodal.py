"""Multimodal samples, token rules, per-phase cost model, presets and the workload generator."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from balancer.cost.model import available_presets, load_cost_model
from balancer.multimodal.cost import (EncoderSpec, available_presets as mm_presets,
    load_mm_cost_model)
from balancer.multimodal.workloads import available as mm_workloads, generate, load_workload
from balancer.multimodal.table import (AUDIO, IMAGE, VIDEO, AudioRule, MediaRules, MultimodalTable,
    VisionRule)


def test_qwen2vl_rule_matches_hand_counts():
    r = VisionRule()
    g = r.image_grids([224, 1080, 28, 1], [224, 1920, 28, 1])
    # 224/28 = 8 -> 64 tokens, 256 patches; 1080x1920 -> 39 x 69 = 2691 tokens
    assert g.tolist() == [[1, 16, 16], [1, 78, 138], [1, 4, 4], [1, 4, 4]]
    tok = MediaRules().llm_tokens(np.zeros(4, np.int8), g)
    assert tok.tolist() == [64, 2691, 4, 4]  # min 4 tokens for tiny images
    assert (g.prod(1) == 4 * tok).all()      # the encoder sees merge^2 = 4x as many patches


@given(st.integers(1, 20000), st.integers(1, 20000), st.integers(1, 64), st.integers(64, 20000))
def test_dynamic_rule_clamps_and_keeps_aspect(h, w, lo, hi):
    r = VisionRule(min_tokens=lo, max_tokens=hi)
    gh, gw = r.token_grid(h, w)
    tok = int(gh[0] * gw[0])
    assert lo <= tok <= hi
    natural = -(-h // 28) * -(-w // 28)
    if lo <= natural <= hi:
        assert tok == natural


def test_fixed_resolution_llava():
    r = VisionRule(spatial_merge=1, fixed_size=336, min_tokens=1, max_tokens=576)
    g = r.image_grids([100, 4000], [5000, 30])
    assert g.tolist() == [[1, 24, 24], [1, 24, 24]]


def test_video_and_audio_grids():
    r = MediaRules()
    v = r.vision.video_grids([9], [224], [448])
    assert v.tolist() == [[5, 16, 32]]  # ceil(9 / 2) temporal patches
    assert r.llm_tokens(np.array([VIDEO], np.int8), v).tolist() == [5 * 8 * 16]
    a = AudioRule().grids([3001])  # 30 s at 100 frames/s (+1): 1501 positions -> 751 tokens
    assert a.tolist() == [[1, 1, 1501]]
    assert r.llm_tokens(np.array([AUDIO], np.int8), a).tolist() == [751]


def test_table_csr_orders_images_videos_audio_per_sample():
    r = MediaRules()
    img = (np.array([0, 2, 2, 3]), r.vision.image_grids([28, 56, 84], [28, 56, 84]))
    vid = (np.array([0, 1, 1, 1]), r.vision.video_grids([4], [56], [56]))
    aud = (np.array([0, 0, 1, 2]), r.audio.grids([400, 800]))
    t = MultimodalTable.build([5, 0, 7], r, images=img, videos=vid, audios=aud)
    assert t.media_offsets.tolist() == [0, 3, 4, 6]
    assert t.media_kind.tolist() == [IMAGE, IMAGE, VIDEO, AUDIO, IMAGE, AUDIO]
    assert t.media_sample.tolist() == [0, 0, 0, 1, 2, 2]
    tok = t.media_tokens.tolist()
    assert tok == [4, 4, 2 * 4, 100, 9, 200]
    assert t.lengths.tolist() == [5 + 16, 100, 7 + 209]
    st_ = t.to_sample_table()
    assert st_.lengths.tolist() == t.lengths.tolist()
    assert st_.extras["media_tokens"][1].tolist() == tok


def test_empty_sample_is_an_error():
    with pytest.raises(ValueError, match="sample 1: no text and no media"):
        MultimodalTable.build([3, 0])


def test_from_dataset_columns():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({
        "text_length": [10, 0, 5],
        "image_sizes": [[[224, 224], [56, 112]], [[448, 448]], []],
        "video_shapes": [[], [], [[8, 224, 224]]],
        "audio_frames": [[], [1000], []],
    })
    t = MultimodalTable.from_dataset(ds)
    want = MultimodalTable.build(
        [10, 0, 5], images=(np.array([0, 2, 3, 3]), VisionRule().image_grids(
            [224, 56, 448], [224, 112, 448])),
        videos=(np.array([0, 0, 0, 1]), VisionRule().video_grids([8], [224], [224])),
        audios=(np.array([0, 0, 1, 1]), AudioRule().grids([1000])))
    for k in ("text", "media_offsets", "media_kind", "media_grid", "media_tokens"):
        assert np.array_equal(getattr(t, k), getattr(want, k)), k
    # the same through a shuffled (indices-mapped) dataset
    t2 = MultimodalTable.from_dataset(ds.select([2, 0, 1]))
    assert t2.lengths.tolist() == [t.lengths[2], t.lengths[0], t.lengths[1]]
    bad = datasets.Dataset.from_dict({"text_length": [1, 2], "image_sizes": [[[3, 4]], [[5]]]})
    with pytest.raises(ValueError, match="sample 1: column 'image_sizes' holds an entry of 1"):
        MultimodalTable.from_dataset(bad)


def test_encoder_cost_is_linear_plus_attention_per_item():
    e = EncoderSpec(hidden=8, layers=2, heads=2, ffn=16, in_dim=3)
    p = np.array([1, 10, 100])
    lin = 2.0 * (2 * (4 * 64 + 2 * 8 * 16) + 3 * 8)
    assert e.linear_flops_per_position() == lin
    assert np.allclose(e.attention_flops(p), 4.0 * 8 * 2 * p.astype(float) ** 2)
    w = EncoderSpec(hidden=8, layers=2, heads=2, ffn=16, in_dim=3, window=16,
                    full_attention_layers=1)
    # 100 positions: six windows of 16 and one of 4 in the windowed layer, full in the other
    assert np.isclose(w.attention_flops(np.array([100]))[0],
                      4.0 * 8 * (100 ** 2 + 6 * 16 ** 2 + 4 ** 2))


def test_presets_load_and_stay_out_of_text_loader():
    names = mm_presets()
    assert {"qwen2-vl-7b", "llava-7b", "omni-7b"} <= set(names)
    assert not set(names) & set(available_presets())
    for n in names:
        c = load_mm_cost_model(n)
        assert c.capacity() > 0 and c.encoder_capacity() > 0
    for n in available_presets():
        load_cost_model(n)  # text presets unaffected
    q = load_mm_cost_model("qwen2-vl-7b")
    k = np.zeros(2, np.int8)
    g = q.rules.vision.image_grids([224, 2240], [224, 2240])
    f, b = q.media_costs(k, g.prod(1), q.rules.llm_tokens(k, g))
    # 100x the patches costs more than 100x: attention is quadratic inside the image
    assert f[1] > 100 * f[0] and (b > f).all()
    llava = load_mm_cost_model("llava-7b")
    f, b = llava.media_costs(np.zeros(1, np.int8), np.array([576]), np.array([576]))
    proj = llava.vision.projector.flops_per_token() * 576
    assert np.isclose(b[0], 2.0 * proj)  # frozen encoder: only the projector trains
    with pytest.raises(ValueError, match="no audio encoder"):
        q.media_costs(np.array([AUDIO], np.int8), np.array([10]), np.array([5]))


def test_workload_generator_seeded_and_varying_mix():
    names = mm_workloads()
    assert "multimodal-mix" in names and "multimodal-omni" in names
    rules = load_mm_cost_model("omni-7b").rules
    a = generate("multimodal-omni", rules, n=4096, seed=3)
    b = generate("multimodal-omni", rules, n=4096, seed=3)
    assert np.array_equal(a.lengths, b.lengths) and np.array_equal(a.media_grid, b.media_grid)
    assert set(np.unique(a.media_kind).tolist()) == {IMAGE, VIDEO, AUDIO}
    # the modality mix changes from block to block, far beyond sampling noise
    blk = load_workload("multimodal-omni").block_samples
    has_img = np.bincount(a.media_sample[a.media_kind == IMAGE], minlength=4096) > 0
    share = has_img[: (4096 // blk) * blk].reshape(-1, blk).mean(1)
    noise = np.sqrt(share.mean() * (1 - share.mean()) / blk)
    assert share.std() > 2 * noise  # ~9x the binomial variance


def test_from_dataset_refuses_unknown_media_columns():
    """A media column named by the caller that the dataset lacks, or a dataset whose media
    column is a near miss of the default name, is an error naming the column and the dataset's
    columns (issue 30 item 10: ``image_size_column="image_size"`` gave 0 media, silently)."""
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text_length": [10, 5],
                                     "image_sizes": [[[224, 224]], []]})
    for kw, name in (({"image_size_column": "image_size"}, "image_size"),
                     ({"video_column": "videos"}, "videos"),
                     ({"audio_column": "audio"}, "audio"),
                     ({"image_tokens_column": "image_tokens"}, "image_tokens")):
        with pytest.raises(ValueError, match=rf"^dataset has no .*column {name!r} \(columns: "
                                             rf"\['image_sizes', 'text_length'\]\)") as e:
            MultimodalTable.from_dataset(ds, **kw)
        assert "\n" not in str(e.value)
    typo = datasets.Dataset.from_dict({"text_length": [10, 5], "image_size": [[[224, 224]], []]})
    with pytest.raises(ValueError, match=r"no image size column 'image_sizes' but has "
                                         r"'image_size'.*image_size_column='image_size'"):
        MultimodalTable.from_dataset(typo)
    t = MultimodalTable.from_dataset(typo, image_size_column="image_size")
    assert t.n_media == 1
    # the default names stay optional: a text-only dataset has no media, no error
    assert MultimodalTable.from_dataset(
        datasets.Dataset.from_dict({"text_length": [3, 4]})).n_media == 0
    assert MultimodalTable.from_dataset(typo, image_size_column=None).n_media == 0


def test_text_lengths_that_are_not_integers_are_refused():
    """build([3, 2.5]) trained 2 text tokens and NaN was reported as a length of -2**63: each
    is one ValueError naming the sample and the value."""
    for bad, shown in ((2.5, "2.5"), (float("nan"), "nan"), (float("inf"), "inf")):
        with pytest.raises(ValueError, match=rf"^sample 1: text length {shown} is not an "
                                             rf"integer"):
            MultimodalTable.build([3, bad])
    assert MultimodalTable.build([3, 2.0]).text.tolist() == [3, 2]
