"""The chat formats by name (data/chat_formats.py), as `target.chat_format` selects them."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from specforge_k25.config import compose_job
from specforge_k25.data.chat_formats import CHAT_FORMATS, chat_format


def test_the_formats_and_an_unknown_one():
    assert set(CHAT_FORMATS) == {"template", "kimi"}
    assert chat_format("template").renderer(object(), SimpleNamespace()) is None  # build_dataset's template path
    with pytest.raises(ValueError, match=r"target.chat_format='chatml': expected one of template \| kimi"):
        chat_format("chatml")


def test_a_kimi_option_under_its_old_name_is_refused_naming_the_new_one():
    with pytest.raises(ValueError, match=r"target.kimi_add_bos is no longer a config key; use target.kimi.add_bos"):
        compose_job(["target=kimi_k25", "target.kimi_add_bos=true"])
    assert compose_job(["target=kimi_k25", "target.kimi.add_bos=true"]).target.kimi.add_bos is True
