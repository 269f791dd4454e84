"""The small-batch section's plan and models (benchmarks/small_batch.py, benchmarks/resnet.py)."""

import torch

from benchmarks import resnet, small_batch


def test_plan_runs_each_model_at_its_batches():
    groups = small_batch.plan(small_batch.MODELS, small_batch.SETTINGS, None, small_batch.MODES,
                              dry=False, compile=True)
    got = {(g.model, g.batch) for g in groups}
    want = {(m, b) for m, bs in small_batch.MODEL_BATCHES.items() for b in bs}
    assert got == want
    for g in groups:
        assert g.views == (1 if g.batch >= small_batch.LARGE_BATCH else 2), g.label
        # compiled at the compile batches only, never the end-to-end row
        assert g.compile == (g.batch in small_batch.COMPILE_BATCHES
                             and g.model != small_batch.END_TO_END), g.label
        assert ("compile_fused" in g.impls) == (g.compile
                                                and g.model in small_batch.COMPILE_FUSED_MODELS)
        if g.model == small_batch.END_TO_END:
            assert g.modes == ("sgd",)
        else:
            assert g.modes[0] == "head"
            assert ("sgd" in g.modes) == (g.model in small_batch.SGD_MODELS
                                          and g.batch in small_batch.SGD_BATCHES)


def test_explicit_batches_run_every_model():
    groups = small_batch.plan(["barlow_twins", "tabular"], ["amp-bf16"], [64], ["head", "sgd"],
                              dry=False, compile=False)
    assert [(g.model, g.batch, g.modes) for g in groups] == [
        ("barlow_twins", 64, ("head", "sgd")), ("tabular", 64, ("head",))]


def test_resnet50_is_torchvisions_architecture():
    """23,508,032 parameters: torchvision's resnet50() (25,557,032) less its fc (2048 x 1000 +
    1000); the features are 2048 wide."""
    model = resnet.ResNet50()
    assert sum(p.numel() for p in model.parameters()) == 23_508_032
    small = resnet.ResNet50(width=8)
    assert small(torch.rand(2, 3, 32, 32)).shape == (2, 256)


def test_models_end_in_what_the_papers_put_last():
    for name in ("barlow_twins", "byol", "simclr_v1", "tabular"):
        head = small_batch.build_head(name, small_batch.DRY_DIMS[name])
        last = list(head.modules())[-1]
        assert isinstance(last, torch.nn.Linear), name  # a plain Linear: fused as one
    e2e = small_batch.END_TO_END
    model = small_batch.build_model(e2e, small_batch.DRY_DIMS[e2e], dry=True)
    out = model(torch.rand(2, 3, small_batch.DRY_IMAGE, small_batch.DRY_IMAGE))
    assert out.shape == (2, small_batch.DRY_DIMS[e2e][2])
