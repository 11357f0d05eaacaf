"""Where keys are in a TOML text: tomllib reports positions only for syntax errors, so the
tenants file's validation finds the line of each key with this light scan (best effort: a
multi-line value is not followed; a key that cannot be found is reported by name alone)."""

import re

_HEADER = re.compile(r"^\s*\[(?!\[)\s*(.+?)\s*\]\s*(?:#.*)?$")
_KEYLINE = re.compile(r"""^\s*((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*=""")
_PART = re.compile(r"""\s*(?:([A-Za-z0-9_-]+)|"([^"]*)"|'([^']*)')\s*(?:\.|$)""")


def _split_key(text):
    parts, pos = [], 0
    while pos < len(text):
        m = _PART.match(text, pos)
        if not m or m.end() == pos:
            return None
        parts.append(next(g for g in m.groups() if g is not None))
        pos = m.end()
    return tuple(parts)


class Lines:
    """Line numbers of table headers and keys, found by a light scan of the text (tomllib does
    not report positions of valid documents). Best effort: multi-line values are not followed."""

    def __init__(self, text):
        self.keys = {}      # key path -> first line
        self.headers = []   # (key path, line) in order
        table = ()
        for no, line in enumerate(text.splitlines(), 1):
            m = _HEADER.match(line)
            if m:
                path = _split_key(m.group(1))
                if path is not None:
                    table = path
                    self.headers.append((path, no))
                    self.keys.setdefault(path, no)
                continue
            m = _KEYLINE.match(line)
            if m:
                path = _split_key(m.group(1))
                if path is not None:
                    self.keys.setdefault(table + path, no)

    def line(self, path):
        """The line of key path; else the first line inside it (a table declared only through
        sub-tables, like [tenant.a] for "tenant"); else its nearest enclosing table; or None."""
        path = tuple(path)
        if path in self.keys:
            return self.keys[path]
        inside = [no for p, no in self.keys.items() if p[:len(path)] == path]
        if inside:
            return min(inside)
        while path:
            if path in self.keys:
                return self.keys[path]
            path = path[:-1]
        return None

    def duplicates(self):
        """[(path, line, first_line)] of tables declared more than once."""
        seen, out = {}, []
        for path, no in self.headers:
            if path in seen:
                out.append((path, no, seen[path]))
            else:
                seen[path] = no
        return out


def blank_section(text, start_line):
    """The text with the table starting at start_line (1-based) commented out."""
    lines = text.splitlines()
    end = len(lines)
    for i in range(start_line, len(lines)):
        if _HEADER.match(lines[i]) or lines[i].lstrip().startswith("[["):
            end = i
            break
    for i in range(start_line - 1, end):
        lines[i] = "# " + lines[i]
    return "\n".join(lines) + "\n"


# The position tomllib appends to its error messages.
AT = re.compile(r"\s*\(at line (\d+), column (\d+)\)\s*$|\s*\(at end of document\)\s*$")
