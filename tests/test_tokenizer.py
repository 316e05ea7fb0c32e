import pytest

from fedrl.tokenizer import CharTokenizer


def test_encode_decode_round_trip():
    tok = CharTokenizer()
    assert tok.decode(tok.encode("0110+9=")) == "0110+9="


def test_prompt_framing_and_eos_stops_decoding():
    tok = CharTokenizer()
    ids = tok.encode_prompt("01")
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.sep_token_id
    assert tok.decode(tok.encode("10") + [tok.eos_token_id] + tok.encode("11")) == "10"


def test_unknown_symbol_is_a_clear_error():
    with pytest.raises(ValueError, match="not in the tokenizer's alphabet"):
        CharTokenizer().encode("0a")


def test_save_and_load(tmp_path):
    tok = CharTokenizer("ab")
    tok.save_pretrained(tmp_path)
    assert CharTokenizer.from_pretrained(tmp_path).vocab == tok.vocab
