"""--capture auto with pieces at TP > 1: every world captures full. Auto hashes a large model's
records, and a micro-batch's or decode call's record at TP > 1 is a slice of the whole along two
dims (its piece and its TP shard), which the hash lanes cannot place (llama-1b on an H100: the
TP=2 micro-batch and decode worlds failed with the reference's shape vs the shard's)."""
from tpdiag.config import CompareConfig
from tpdiag.runner.compare import pieces_capture


def cfg(**kw):
    return CompareConfig(**{"model": "tiny-llama", "degrees": (1, 2), **kw})


def test_auto_capture_is_full_where_pieces_run_at_tp_above_1():
    assert pieces_capture(cfg(capture="auto", micro_batches=(2, 1))).capture == "full"
    assert pieces_capture(cfg(capture="auto", modes=("prefill", "decode"), backward=False)).capture == "full"
    # TP=1 pieces hash fine, plain TP runs have no pieces, an explicit choice is the user's
    assert pieces_capture(cfg(capture="auto", degrees=(1,), micro_batches=(2, 1))).capture == "auto"
    assert pieces_capture(cfg(capture="auto")).capture == "auto"
    assert pieces_capture(cfg(capture="full", micro_batches=(2, 1))).capture == "full"
