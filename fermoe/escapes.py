"""Backslash escapes in command-line text (prompts, stop strings), as llama.cpp's CLI
reads them (common's string_process_escapes): a shell passes `-p "a\nb"` as a
backslash and an n, and the user means a newline."""
from __future__ import annotations

from shared.errors import FermoeError

_SIMPLE = {"n": b"\n", "r": b"\r", "t": b"\t", "'": b"'", '"': b'"', "\\": b"\\", "?": b"?",
           "a": b"\a", "b": b"\b", "f": b"\f", "v": b"\v"}
_HEX = set("0123456789abcdefABCDEF")


def process_escapes(text: str, option: str = "text") -> str:
    r"""\n \r \t \' \" \\ \? \a \b \f \v and \xHH (one byte: a UTF-8 sequence is written
    byte by byte, \xc3\xa9 is é); any other backslash stays as it is, as in llama.cpp.
    `option` names the text in the error of \x bytes that are not UTF-8."""
    out, i, n = bytearray(), 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n:
            e = text[i + 1]
            if e in _SIMPLE:
                out += _SIMPLE[e]
                i += 2
                continue
            digits = text[i + 2:i + 4]
            if e == "x" and len(digits) == 2 and set(digits) <= _HEX:
                out.append(int(digits, 16))
                i += 4
                continue
        out += c.encode("utf-8", "surrogateescape")
        i += 1
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError as err:
        raise FermoeError(f"{option} {text!r}: its \\x escapes give bytes that are not UTF-8 ({err.reason} at byte "
                          f"{err.start}); give a character as all the bytes of its UTF-8 form, or use --no-escape")
