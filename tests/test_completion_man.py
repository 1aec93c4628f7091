"""Shell completion and the man page, generated from the argument parser: held to the parser.

The expected commands and options are read from `build_parser()` with argparse itself (not
through kdash.cli_spec), so a command or option the generators miss, or one added without a
help text, fails here. The bash script is driven in a real bash, through COMP_WORDS and the
completion function it registers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

import pytest

from kdash.cli import build_parser, main


def parser_commands() -> dict[str, argparse.ArgumentParser]:
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def flags_of(p: argparse.ArgumentParser) -> set[str]:
    return {f for a in p._actions for f in a.option_strings if a.help != argparse.SUPPRESS}


def generated(*argv: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "kdash", *argv], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("completion") / "kdash.bash"
    path.write_text(generated("completion", "bash"))
    return path


def complete(script, *words: str, cwd=None) -> list[str]:
    """What bash offers for the command line `words` (the last one being completed)."""
    quoted = " ".join("'" + w.replace("'", "'\\''") + "'" for w in words)
    prog = (
        f"source '{script}'\n"
        f"COMP_WORDS=({quoted}); COMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 ))\n"
        'COMP_LINE="${COMP_WORDS[*]}"; COMP_POINT=${#COMP_LINE}\n'
        "spec=$(complete -p kdash); fn=${spec##*-F }; fn=${fn%% *}\n"
        '"$fn" kdash "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"\n'
        "printf '%s\\n' \"${COMPREPLY[@]}\"\n"
    )
    r = subprocess.run(["bash", "-c", prog], capture_output=True, text=True, cwd=cwd, timeout=30)
    assert r.returncode == 0, r.stderr
    return [w for w in r.stdout.splitlines() if w]


pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def test_the_bash_script_is_valid_bash(bash_script):
    r = subprocess.run(["bash", "-n", str(bash_script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_bash_completes_every_command(bash_script):
    commands = parser_commands()
    assert set(commands) <= set(complete(bash_script, "kdash", ""))
    for name in commands:
        assert complete(bash_script, "kdash", name[:3]) == sorted(
            n for n in commands if n.startswith(name[:3])
        ), name


def test_bash_completes_every_option_of_every_command(bash_script):
    for name, sp in parser_commands().items():
        offered = set(complete(bash_script, "kdash", name, "-"))
        missing = flags_of(sp) - offered
        assert not missing, f"kdash {name}: bash does not offer {sorted(missing)}"
        assert offered - {"--"} <= flags_of(sp), f"kdash {name}: options it does not have"


def test_bash_completes_option_values(bash_script, tmp_path):
    (tmp_path / "run1.kdash").write_text("")
    (tmp_path / "notes.txt").write_text("")
    assert sorted(complete(bash_script, "kdash", "completion", "")) == ["bash", "fish", "zsh"]
    assert {"dark", "light", "mono"} <= set(complete(bash_script, "kdash", "attach", "--theme", ""))
    # a file for an option that names one, and for a capture argument
    assert complete(bash_script, "kdash", "demo", "-o", "run", cwd=tmp_path) == ["run1.kdash"]
    assert complete(bash_script, "kdash", "report", "r", cwd=tmp_path) == ["run1.kdash"]
    # a number is not completed with options or files
    assert complete(bash_script, "kdash", "attach", "--interval", "", cwd=tmp_path) == []
    pids = complete(bash_script, "kdash", "attach", "--pid", "")
    assert str(os.getpid()) in pids


def test_bash_completes_the_command_after_run_dashdash(bash_script):
    offered = complete(bash_script, "kdash", "run", "--headless", "--", "bas")
    assert "bash" in offered
    assert not any(w.startswith("-") for w in offered)


def test_zsh_and_fish_scripts_name_every_command_and_option():
    zsh = generated("completion", "zsh")
    fish = generated("completion", "fish")
    assert zsh.startswith("#compdef kdash")
    for name, sp in parser_commands().items():
        assert f"'{name}:" in zsh and f"-a '{name}'" in fish, name
        for f in flags_of(sp):
            long_or_short = f"-l {f[2:]}" if f.startswith("--") else f"-s {f[1:]}"
            assert long_or_short in fish, (name, f)
            assert f in zsh, (name, f)
    if shutil.which("zsh"):
        r = subprocess.run(["zsh", "-n", "-c", zsh], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_an_unknown_shell_is_one_line_and_exit_2(capsys):
    assert main(["completion", "tcsh"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kdash: ") and err.count("\n") == 1 and "tcsh" in err


# ---- the man page ---------------------------------------------------------------------------


def roff(text: str) -> str:
    """The man page source with roff's escapes undone, to find names in it."""
    return text.replace("\\-", "-").replace("\\fB", "").replace("\\fI", "").replace("\\fR", "")


def sections(page: str) -> dict[str, str]:
    """`.SS kdash NAME` -> its text, up to the next section."""
    out: dict[str, str] = {}
    current = None
    for line in page.splitlines():
        if line.startswith(".SS kdash "):
            current = line.removeprefix(".SS kdash ").strip()
            out[current] = ""
        elif line.startswith(".SH"):
            current = None
        elif current is not None:
            out[current] += line + "\n"
    return out


def test_the_man_page_documents_every_command_and_option():
    page = roff(generated("man"))
    assert page.startswith(".TH KDASH 1 ")
    by_command = sections(page)
    for name, sp in parser_commands().items():
        assert name in by_command, f"no section for kdash {name}"
        text = by_command[name]
        for a in sp._actions:
            if a.help == argparse.SUPPRESS:
                continue
            what = " or ".join(a.option_strings) or a.dest
            # documented: a help text in the parser, and the man page shows it
            assert a.help, f"kdash {name} {what} has no help text"
            for f in a.option_strings:
                assert f"\n{f}" in "\n" + text or f", {f}" in text, f"kdash {name}: {f}"
            first_words = " ".join(a.help.replace("%%", "%").split()[:3])
            assert first_words in " ".join(text.split()), f"kdash {name} {what}: no help shown"


def test_the_man_page_is_clean_roff():
    if shutil.which("groff") is None:
        pytest.skip("groff not installed")
    r = subprocess.run(
        ["groff", "-man", "-Tutf8", "-ww", "-z"],
        input=generated("man"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
