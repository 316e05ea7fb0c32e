"""fedrl/bounds.py: an error names each setting out of bounds, as its user spells it, and its value."""

from types import SimpleNamespace

import pytest

from fedrl.bounds import at_least


def test_each_setting_out_of_bounds_is_named_with_its_value_and_the_rest_are_not():
    settings = SimpleNamespace(max_threads=-1, upload_kbps=0, download_kbps=-2.5)
    at_least(settings, -1, "max_threads", "upload_kbps")  # the bound itself is in bounds
    with pytest.raises(ValueError) as err:
        at_least(settings, 0, *vars(settings), label=lambda name: name.replace("_", "-"))
    assert str(err.value) == "max-threads must be >= 0, got -1; download-kbps must be >= 0, got -2.5"
