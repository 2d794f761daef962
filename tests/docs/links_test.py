#!/usr/bin/env python3
"""Every relative link in the repository's Markdown resolves (ctest docs_links, label docs).

    links_test.py SOURCE_DIR

A link names a file or directory that exists inside the repository, and its #anchor, if any,
names a heading of the Markdown file it points at, as GitHub makes anchors of headings. Links
to the web (http, https, mailto) are not followed: the suite stays off the network. A link that
leaves the repository fails too: the docs must stand on their own.
"""
import os
import re
import subprocess
import sys

# [text](target) and [text](target "title"); images are links too. Not inside code spans.
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"`[^`]*`")


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading)  # inline HTML
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = text.replace("`", "").lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        seen = {}
        found = set()
        fenced = False
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.lstrip().startswith("```"):
                    fenced = not fenced
                    continue
                m = None if fenced else HEADING.match(line)
                if not m:
                    continue
                base = slug(m.group(2))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
        cache[path] = found
    return cache[path]


def markdown_files(root):
    out = subprocess.run(["git", "-C", root, "ls-files", "*.md", "**/*.md"],
                         capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        return sorted(set(out.stdout.split()))
    # Not a git checkout (an exported tree): every .md outside build trees.
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".git" and not d.startswith("build")]
        found += [os.path.relpath(os.path.join(dirpath, n), root)
                  for n in filenames if n.endswith(".md")]
    return sorted(found)


def check(root):
    root = os.path.realpath(root)
    problems = []
    files = markdown_files(root)
    for rel in files:
        path = os.path.join(root, rel)
        fenced = False
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.lstrip().startswith("```"):
                    fenced = not fenced
                    continue
                if fenced:
                    continue
                for m in LINK.finditer(CODE_SPAN.sub("", line)):
                    target = m.group(1)
                    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                        continue
                    file_part, _, anchor = target.partition("#")
                    where = f"{rel}:{number}: ({target})"
                    dest = (os.path.realpath(os.path.join(os.path.dirname(path), file_part))
                            if file_part else path)
                    if dest != root and not dest.startswith(root + os.sep):
                        problems.append(f"{where}: points outside the repository")
                        continue
                    if not os.path.exists(dest):
                        problems.append(f"{where}: no such file")
                        continue
                    if anchor and dest.endswith(".md") and anchor not in anchors(dest):
                        problems.append(f"{where}: no heading makes the anchor #{anchor}")
    return files, problems


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    files, problems = check(sys.argv[1])
    for p in problems:
        print(p)
    print(f"{len(files)} Markdown files, {len(problems)} broken links")
    return 1 if problems or not files else 0


if __name__ == "__main__":
    sys.exit(main())
