"""The command-line parsers' one rule: an argument error is one line naming the problem and pointing at --help,
not the whole usage text (imports nothing heavy, so `jaxkv convert --help` stays fast)."""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors are ``PROG: error: MESSAGE (see PROG --help)`` on one line, exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
