#!/usr/bin/env python3
"""Keeps the layout rules of issue 29 on every test run (scripts/test.sh runs it last).

  - no source file under agent/ over 600 lines;
  - every main() (agent, fkserve, fkctl, webhook) at most 80 lines;
  - no function over 80 lines in agent/fuse, agent/volume, agent/kube or agent/webhook.

Functions are found by brace matching with comments, strings and character literals skipped: a
brace that opens a body right after a parameter list's ")" (and qualifiers such as const,
override, noexcept or a trailing return type) starts a function; a lambda's body counts toward the
function that holds it. Prints each breach and exits 1, or prints "layout: OK".
  python3 scripts/check_layout.py [repo root]
"""
import os
import re
import sys

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
FUNCTION_DIRS = ("agent/fuse", "agent/volume", "agent/kube", "agent/webhook")
SOURCE_SUFFIXES = (".cc", ".h")


def blank_comments_and_strings(text):
    """Returns text with comments, string and char literals replaced by spaces (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i)
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            # A digit separator (1'000) is not a character literal.
            if c == "'" and i > 0 and text[i - 1].isalnum() and i + 1 < n and text[i + 1].isalnum() \
                    and not text[i - 1].isalpha():
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


QUALIFIERS = re.compile(r"\)\s*(?:const|override|final|noexcept|mutable|&&|&|\s|->\s*[\w:<>,\s*&]+)*$")
NOT_FUNCTIONS = ("if", "for", "while", "switch", "catch", "return", "sizeof", "decltype")


def functions(text):
    """Yields (name, first line, line count) for each function body at file/namespace/class scope."""
    code = blank_comments_and_strings(text)
    stack = []  # per open brace: ("function", name, line) or ("other",)
    line = 1
    for i, c in enumerate(code):
        if c == "\n":
            line += 1
        elif c == "{":
            inside_function = any(kind == "function" for kind, *_ in stack)
            head = code[max(0, i - 400):i]
            head = head.split(";")[-1].split("}")[-1].split("{")[-1]
            name = None
            if not inside_function and QUALIFIERS.search(head.rstrip()):
                # Skip a constructor's initializer list: the name is before the first "(".
                m = re.search(r"([~\w:]+)\s*\(", head)
                if m and m.group(1).split("::")[-1] not in NOT_FUNCTIONS:
                    name = m.group(1)
            stack.append(("function", name, line) if name else ("other",))
        elif c == "}" and stack:
            top = stack.pop()
            if top[0] == "function":
                yield top[1], top[2], line - top[2] + 1


def source_files(root, under):
    for base, _, names in os.walk(os.path.join(root, under)):
        for name in sorted(names):
            if name.endswith(SOURCE_SUFFIXES):
                yield os.path.join(base, name)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    root = os.path.abspath(root)
    breaches = []
    for path in source_files(root, "agent"):
        rel = os.path.relpath(path, root)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            breaches.append(f"{rel}: {lines} lines (at most {MAX_FILE_LINES})")
        checked = rel.startswith(FUNCTION_DIRS)
        for name, first, count in functions(text):
            if name == "main" and count > MAX_FUNCTION_LINES:
                breaches.append(f"{rel}:{first}: main() is {count} lines (at most {MAX_FUNCTION_LINES})")
            elif checked and count > MAX_FUNCTION_LINES:
                breaches.append(f"{rel}:{first}: {name}() is {count} lines (at most {MAX_FUNCTION_LINES})")
    for b in breaches:
        print("layout: " + b)
    if breaches:
        print(f"layout: {len(breaches)} breach(es) of the rules in scripts/check_layout.py")
        return 1
    print("layout: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
