"""The inventory loader: valid files load, every kind of bad input is one line naming file:line."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_ftctl.errors import ExitCode, InvalidInput, InventoryError
from dynamo_ftctl.inventory import MAX_YAML_BYTES, Inventory, load_inventory, parse_inventory
from dynamo_ftctl.structs import convert_struct, replace, to_data

ROOT = Path(__file__).resolve().parents[3]
LOCAL = ROOT / "examples" / "local.yaml"

VALID = """\
cluster: demo
workers:
  - name: w1
    url: http://127.0.0.1:8101
    model: m
    group: tp0
    faults: [kill, xid48]
  - name: w2
    url: https://10.0.0.2:8000/
    model: m
groups:
  - {name: tp0, tp: 2}
"""


def write(tmp_path: Path, text: str | bytes, name: str = "ftctl.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def error_for(tmp_path: Path, text: str | bytes) -> InventoryError:
    path = write(tmp_path, text)
    with pytest.raises(InventoryError) as info:
        load_inventory(path)
    assert info.value.exit_code == ExitCode.USAGE
    assert "\n" not in str(info.value)
    assert str(path) in str(info.value)
    return info.value


def test_example_inventory_loads() -> None:
    """examples/local.yaml is valid and has three sim workers."""
    inventory = load_inventory(LOCAL)
    assert [w.name for w in inventory.workers] == ["w1", "w2", "w3"]
    assert all(w.launch and w.launch.sim for w in inventory.workers)
    assert inventory.source == LOCAL


def test_valid_inventory_fields(tmp_path: Path) -> None:
    """Values land in frozen models; URLs lose their trailing slash; defaults fill the rest."""
    inventory = load_inventory(write(tmp_path, VALID))
    w2 = inventory.worker("w2")
    assert w2.url == "https://10.0.0.2:8000"
    assert inventory.worker("w1").faults == ("kill", "xid48")
    assert inventory.canary.ema_alpha == 0.1
    assert inventory.lock.backend == "flock"
    with pytest.raises(AttributeError, match="immutable"):
        w2.url = "http://x"  # type: ignore[misc]


def test_unknown_worker_suggests_close_name(tmp_path: Path) -> None:
    """Asking for a missing worker names the closest one."""
    inventory = load_inventory(write(tmp_path, VALID))
    with pytest.raises(InvalidInput, match="did you mean 'w1'"):
        inventory.worker("w11")


@pytest.mark.parametrize(
    ("text", "line", "key", "reason"),
    [
        (VALID.replace("http://127.0.0.1:8101", "htp://x"), 4, "workers[0].url",
         "not a valid http(s) URL"),
        (VALID.replace("    model: m\n    group", "    modle: m\n    group"), 5, "workers[0].modle",
         "unknown key; did you mean 'model'?"),
        (VALID.replace("name: w2", "name: w1"), 8, "workers[1].name", "duplicate worker name"),
        (VALID.replace("group: tp0", "group: tp9"), 6, "workers[0].group", "unknown group 'tp9'"),
        (VALID.replace("xid48", "xid9999"), 7, "workers[0].faults[1]", "unknown fault 'xid9999'"),
        (VALID.replace("[kill, xid48]", "[kil]"), 7, "workers[0].faults[0]", "did you mean 'kill'"),
        (VALID.replace("tp: 2", "tp: two"), 12, "groups[0].tp", "expected an integer"),
        (VALID + "lock: {backend: zookeeper}\n", 13, "lock.backend", "must be one of"),
        (VALID.replace("    model: m\ngroups", "groups"), 8, "workers[1].model",
         "missing required key"),
        (VALID + "proxy: {listen: nowhere}\n", 13, "proxy.listen", "expected HOST:PORT"),
        (VALID + "cluster: again\n", 13, "cluster", "duplicate key"),
        (VALID + "canary:\n  actions:\n    - {on: [sick], http: 'http://a'}\n", 15,
         "canary.actions[0].on[0]", "must be one of 'healthy', 'suspicious'"),
        (VALID + "canary:\n  actions:\n    - {on: [dead]}\n", 15, "canary.actions[0].http",
         "give exactly one of 'http' or 'command'"),
        (VALID.replace("    model: m\ngroups", "    model: m\n    protected: yes\ngroups"), 11,
         "workers[1].protected", "expected true or false, got a string"),
        (VALID.replace("[kill, xid48]", "kill"), 7, "workers[0].faults",
         "expected a list, got a string"),
        (VALID + "canary: {ema_alpha: 2}\n", 13, "canary.ema_alpha", "expected a number <= 1.0"),
        (VALID.replace("model: m\n    group", "model: ''\n    group"), 5, "workers[0].model",
         "expected a string of at least 1 character"),
    ],
)
def test_invalid_inventory_names_line_and_key(
    tmp_path: Path, text: str, line: int, key: str, reason: str,
) -> None:
    """Each schema violation is reported as file:line: key: reason."""
    err = error_for(tmp_path, text)
    assert err.line == line, str(err)
    assert err.key == key, str(err)
    assert reason in str(err)
    assert str(err).startswith(f"{tmp_path / 'ftctl.yaml'}:{line}: {key}: ")


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("", "empty document"),
        ("# only a comment\n", "empty document"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "binary data"),
        (b"cluster: caf\xe9\n", "not UTF-8"),
        ("cluster: [unclosed\n", "YAML syntax error"),
        ("- a\n- b\n", "got a list"),
        ("just a string\n", "got a string"),
        ("cluster: demo\n", "at least one worker, or a discovery entry"),
        ("cluster: demo\nworkers: []\n", "at least one worker, or a discovery entry"),
        ("cluster: demo\nworkers: {w1: {}}\n", "expected a list"),
    ],
)
def test_bad_files_give_one_line(tmp_path: Path, content: str | bytes, reason: str) -> None:
    """Empty, binary, non-UTF-8, broken YAML and wrong shapes are one-line errors."""
    err = error_for(tmp_path, content)
    assert reason in str(err)


def test_huge_file_is_refused_before_parsing(tmp_path: Path) -> None:
    """A file over 1 MiB is rejected with its size, without being parsed."""
    err = error_for(tmp_path, "# " + "x" * MAX_YAML_BYTES + "\n")
    assert "1 MiB" in str(err)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    """A missing path or a directory is a one-line error, not a traceback."""
    with pytest.raises(InventoryError, match="no such file"):
        load_inventory(tmp_path / "absent.yaml")
    with pytest.raises(InventoryError, match="is a directory"):
        load_inventory(tmp_path)


def test_alias_bomb_is_bounded(tmp_path: Path) -> None:
    """A YAML alias bomb is rejected quickly instead of expanding."""
    bomb = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for index in range(1, 9):
        prev = "a" if index == 1 else f"a{index - 1}"
        bomb.append(f"a{index}: &a{index} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]")
    bomb.append("cluster: *a8\nworkers: *a8\n")
    err = error_for(tmp_path, "\n".join(bomb))
    assert "aliases repeat more than 10,000 nodes" in str(err)


def test_yaml_12_booleans_keep_on_and_no_as_strings(tmp_path: Path) -> None:
    """`on:` (canary actions) and a worker called `no` stay strings, as in YAML 1.2."""
    text = VALID.replace("name: w2", "name: no") + (
        "canary:\n  actions:\n    - {on: [unhealthy, dead], command: ['true']}\n"
    )
    inventory = load_inventory(write(tmp_path, text))
    assert inventory.worker("no").url == "https://10.0.0.2:8000"
    assert inventory.canary.actions[0].on == ("unhealthy", "dead")
    assert inventory.canary.actions[0].command == ("true",)


def test_copy_and_dump_round_trip(tmp_path: Path) -> None:
    """to_data gives the file's keys back; replace keeps the source file."""
    inventory = load_inventory(write(tmp_path, VALID))
    again = convert_struct(to_data(inventory), Inventory)
    assert again == inventory
    moved = replace(inventory, cluster="other")
    assert moved.cluster == "other"
    assert moved.source == inventory.source == tmp_path / "ftctl.yaml"


def test_parse_inventory_from_text() -> None:
    """Text can be validated without a file; the error names the given label."""
    assert isinstance(parse_inventory(VALID, "inline.yaml"), Inventory)
    with pytest.raises(InventoryError, match=r"^inline.yaml:1: "):
        parse_inventory("workers: 1\n", "inline.yaml")


def test_resolve_is_relative_to_the_inventory(tmp_path: Path) -> None:
    """Relative paths in the inventory resolve against its folder."""
    inventory = load_inventory(write(tmp_path, VALID))
    assert inventory.resolve("canaries/x.yaml") == tmp_path.resolve() / "canaries/x.yaml"
    assert inventory.resolve("/abs/x.yaml") == Path("/abs/x.yaml")


@pytest.mark.parametrize(("yaml_key", "shown"), [
    ('"\\r"', "workers[0]['\\r']"),
    ('"a b"', "workers[0]['a b']"),
    ('"x.y"', "workers[0]['x.y']"),
    ("urll", "workers[0].urll"),
])
def test_odd_keys_are_quoted_in_errors(tmp_path: Path, yaml_key: str, shown: str) -> None:
    """A key with a control character, a space or a dot is quoted, so the error stays one line."""
    err = error_for(tmp_path, VALID.replace("    model: m\n    group", f"    {yaml_key}: 1\n    group"))
    assert f":5: {shown}: unknown key" in str(err)
    assert str(err).isprintable()


def test_error_lines_escape_control_characters(capsys: pytest.CaptureFixture[str]) -> None:
    """output.error writes one line whatever the message holds."""
    from dynamo_ftctl.output import error

    error("bad value 'a\rb\nc'")
    assert capsys.readouterr().err == "error: bad value 'a\\rb\\nc'\n"


def test_sim_launch_warmup_is_validated() -> None:
    """`launch.sim.warmup_s` is read as seconds (absent: the sim's default); negative is refused."""
    sim = ("cluster: c\nworkers:\n  - {name: w1, url: 'http://127.0.0.1:1', model: m, "
           "launch: {sim: %s}}\n")

    def warmup(launch_sim: str) -> float | None:
        launch = parse_inventory(sim % launch_sim, "inline.yaml").workers[0].launch
        assert launch is not None
        assert launch.sim is not None
        return launch.sim.warmup_s

    assert warmup("{warmup_s: 2.5}") == 2.5
    assert warmup("{}") is None
    with pytest.raises(InventoryError, match="warmup_s"):
        warmup("{warmup_s: -1}")
