"""Byte sizes as users write them (tenant quotas, knobs, CLI): decimal units are powers of ten,
binary units powers of two, in every letter case; bad input is a ValueError naming the field."""

import pytest

from ascend_pool.errors import ConfigError
from ascend_pool.tenants.quota_spec import parse_quota
from ascend_pool.units import format_bytes, parse_bytes

# unit spellings -> bytes per unit; every case variant of each is checked below
DECIMAL = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
BINARY = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def case_variants(unit):
    """Every upper/lower-case spelling of unit ('gb' -> gb, gB, Gb, GB)."""
    out = [""]
    for ch in unit:
        out = [o + c for o in out for c in {ch.lower(), ch.upper()}]
    return sorted(set(out))


@pytest.mark.parametrize("unit,factor", sorted({**DECIMAL, **BINARY}.items()))
def test_every_unit_in_every_case(unit, factor):
    for spelled in case_variants(unit):
        assert parse_bytes(f"16{spelled}") == 16 * factor, spelled
        assert parse_bytes(f" 3 {spelled} ") == 3 * factor, spelled
        assert parse_bytes(f"0{spelled}") == 0, spelled
        assert parse_bytes(f"1{spelled}") == factor, spelled


def test_a_16GB_tenant_gets_16e9_bytes_not_16GiB():
    # the difference a user would be billed for: 7.4 % at GB scale
    assert parse_bytes("16GB") == 16_000_000_000
    assert parse_bytes("16GiB") == 17_179_869_184
    assert parse_bytes("512MB") == 512_000_000 and parse_bytes("512MiB") == 536_870_912


def test_plain_numbers_and_bytes_suffix():
    assert parse_bytes(0) == 0
    assert parse_bytes(1048576) == 1048576
    assert parse_bytes("1048576") == 1048576
    assert parse_bytes("7B") == 7 and parse_bytes("7b") == 7
    assert parse_bytes(2**70) == 2**70  # ints are exact at any size
    assert parse_bytes("123456789012345678901234567890") == 123456789012345678901234567890
    assert parse_bytes(3.9) == 3  # whole bytes, rounded down


def test_fractions_round_down_to_whole_bytes():
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("1.5GiB") == 3 * 2**29
    assert parse_bytes(".5KiB") == 512
    assert parse_bytes("0.5k") == 512
    assert parse_bytes("1.0005KB") == 1000  # 1000.5 bytes -> 1000
    assert parse_bytes("2.") == 2


@pytest.mark.parametrize("bad", ["", " ", "GB", "-1", "-1GB", "1e9", "1,5GB", "1 2GB", "8XB", "8GBB", "8 G B",
                                 "0x10", "nan", "inf", "1.2.3MB", "8iB", "8Gi"])
def test_unreadable_strings_are_value_errors_naming_the_field(bad):
    with pytest.raises(ValueError, match="quota"):
        parse_bytes(bad, what="quota")


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), float("inf"), True, False, None, [1], b"1GB"])
def test_bad_values_are_value_errors(bad):
    with pytest.raises(ValueError, match="limit"):
        parse_bytes(bad, what="limit")


def test_fractions_are_exact_bytes_not_a_floats_product():
    # 4.1 * 10**9 as floats is 4099999999.9999995: a quota of "4.1GB" was a byte short
    assert parse_bytes("4.1GB") == 4_100_000_000
    assert parse_bytes("1.001KB") == 1001
    assert parse_bytes("12345678901234567.5") == 12345678901234567  # rounded down past 2**53 too
    assert parse_quota("4.1GB").bytes == 4_100_000_000
    assert parse_quota("1.001KB").bytes == 1001


def test_more_digits_than_int_reads_are_larger_than_any_byte_count():
    # past int()'s 4300 digits: the field's message, not Python's bare "Exceeds the limit"
    for text in ("1" * 5000, "1" * 5000 + ".5"):
        with pytest.raises(ValueError, match="limit: .* is larger than any byte count"):
            parse_bytes(text, what="limit")
    with pytest.raises(ConfigError, match="quota: .* is larger than any device"):
        parse_quota("1" * 5000 + "GB")


@pytest.mark.parametrize("text, why", [("1e3", ": no exponent is taken (write 1000)"), ("1.5e9", ": no exponent is taken (write 1500000000)"),
                                       ("2.5e-1", ": no exponent is taken"), ("-1", ": negative"), ("-0.5GB", ": negative"),
                                       ("nan", ": not a finite number"), ("1e400", ": not a finite number")])
def test_a_number_refused_as_a_size_text_says_why(text, why):
    # the float 1e3 is 1000 bytes; the text "1e3" was refused as if it were no number at all
    with pytest.raises(ValueError) as e:
        parse_bytes(text, what="--device-bytes")
    assert str(e.value).startswith(f"--device-bytes: cannot read {text!r} as a byte size{why} (examples:"), str(e.value)


def test_too_many_digits_before_a_point_is_an_error_not_inf():
    with pytest.raises(ValueError, match="larger than any byte count"):
        parse_bytes("9" * 400 + ".5TB")


def test_format_bytes_uses_binary_units():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1024) == "1.00 KiB"
    assert format_bytes(3 * 2**29) == "1.50 GiB"
    assert format_bytes(2**50) == "1024.00 TiB"
