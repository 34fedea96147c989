"""`--model hf:X` where X is no directory (helper hnew15). Before: `no config.json in
'meta-llama/Llama-3.2-1B'` for a Hub id - as if the directory existed - with no word that tpdiag
reads local directories only, nor how to get one."""
import pytest

from tpdiag.errors import BadInput
from tpdiag.models.spec import parse_spec


def test_a_hub_id_is_told_to_download_first():
    with pytest.raises(BadInput) as e:
        parse_spec("hf:meta-llama/Llama-3.2-1B")
    msg = str(e.value)
    assert "no directory 'meta-llama/Llama-3.2-1B'" in msg and "\n" not in msg
    assert "hf download meta-llama/Llama-3.2-1B --local-dir DIR" in msg


def test_a_missing_directory_and_an_empty_one_read_apart(tmp_path):
    with pytest.raises(BadInput, match="no directory") as e:
        parse_spec(f"hf:{tmp_path}/nope")
    assert "download" not in str(e.value)  # a path, not a Hub id
    with pytest.raises(BadInput, match="no config.json in"):  # it exists: what it lacks
        parse_spec(f"hf:{tmp_path}")
