"""The vision scenarios' helpers in tests/support/llamatools.py: the PNG writer and the projector
of a scenario (no llama.cpp tool is run here)."""

from __future__ import annotations

import struct
import zlib

from tests.support import llamatools as lt


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    out, pos = [], 8
    while pos < len(data):
        (n,) = struct.unpack_from(">I", data, pos)
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack_from(">I", data, pos + 8 + n)
        assert crc == zlib.crc32(kind + body), kind
        out.append((kind, body))
        pos += 12 + n
    return out


def test_png_is_a_valid_rgb_image_of_its_seed():
    data = lt.png(32, 24, seed=7)
    chunks = _chunks(data)
    assert [k for k, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    w, h, depth, color, comp, filt, inter = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (w, h, depth, color, comp, filt, inter) == (32, 24, 8, 2, 0, 0, 0)
    raw = zlib.decompress(chunks[1][1])
    assert len(raw) == 24 * (1 + 3 * 32)
    assert all(raw[y * 97] == 0 for y in range(24))  # filter type 0 on every row
    assert lt.png(32, 24, seed=7) == data  # deterministic
    assert lt.png(32, 24, seed=8) != data  # and the seed changes the pixels


def test_every_vision_scenario_names_a_projector_with_its_ops():
    vision = [s for s in lt.SETS["long"] if s.mmproj is not None]
    assert {lt.projector(s) for s in vision} == set(lt.VISION_OPS)
    assert all(s.survey and s.tool == "server" for s in vision)
    assert [s.name for s in lt.CI if s.mmproj is not None] == ["vision-mlp", "vision-gemma3"]
    assert lt.projector(lt.Scenario("x", "tiny", mmproj=())) == "mlp"
