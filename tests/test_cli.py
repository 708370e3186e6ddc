"""The heloco-jax console script: usage, the train stub, unknown commands."""

import subprocess
import sys

from heloco_jax import cli


def test_train_without_workdir_fails_with_usage(capsys):
  assert cli.main(["train"]) == 2
  assert "--workdir is required" in capsys.readouterr().err


def test_train_says_not_yet_available(capsys):
  assert cli.main(["train", "--workdir=/tmp/unused"]) == 2
  assert "not yet available" in capsys.readouterr().err


def test_unknown_command_lists_the_allowed_ones(capsys):
  assert cli.main(["fly"]) == 2
  assert "unknown command 'fly'; allowed: train, corpus" in capsys.readouterr().err


def test_help_exits_zero(capsys):
  assert cli.main(["--help"]) == 0
  assert "heloco-jax train --workdir=DIR" in capsys.readouterr().out


def test_module_entry_point_matches_console_script():
  result = subprocess.run([sys.executable, "-m", "heloco_jax.train", "--workdir=/tmp/unused"],
                          capture_output=True, text=True, check=False)
  assert result.returncode == 2 and "not yet available" in result.stderr
