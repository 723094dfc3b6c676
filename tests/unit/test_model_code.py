"""Finding and importing a model.py (handlers/djl/model_code.py) as DJL LMI finds it, and DJL's
decorators where djl_python is not installed (handlers/djl/decorators.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from model_py_files import (
    ADAPTER_INPUT,
    FORMATTERS,
    INIT_HANDLER,
    PREDICTION_HANDLER,
    SAGEMAKER_LLM,
    write,
)
from optional_deps import required

from handlers.djl.model_code import ModelCodeError, load

ROOT = Path(__file__).resolve().parents[2]
# Asked at collection, before a test of this session could register the stand-in.
DJL_PYTHON_INSTALLED = importlib.util.find_spec("djl_python") is not None


def said(code, *fields: str) -> list[str | None]:
    return [getattr(code, field).said if getattr(code, field) else None for field in fields]


FIELDS = ("input_formatter", "output_formatter", "prediction_handler", "init_handler")


def test_no_model_py_is_no_code(tmp_path):
    assert load([tmp_path], {"alpha": tmp_path / "alpha"}) is None


def test_the_decorated_functions_are_found_by_their_decorators(tmp_path):
    codes = load([write(tmp_path / "m", FORMATTERS)], {})
    assert said(codes.base, *FIELDS) == [
        "input formatter custom_input_formatter (model.py of the model)",
        "output formatter custom_output_formatter (model.py of the model)", None, None]
    assert not codes.base.sagemaker and not codes.predicts


def test_handlers_answer_whole_predictions(tmp_path):
    predicting = load([write(tmp_path / "p", PREDICTION_HANDLER)], {})
    assert said(predicting.base, "prediction_handler") == [
        "prediction handler answer_each (model.py of the model)"]
    assert predicting.predicts
    initialised = load([write(tmp_path / "i", INIT_HANDLER, {"keywords.txt": "a b"})], {})
    assert initialised.model.words == ["a", "b"]  # the init handler ran, once, at load
    assert initialised.predicts


def test_sagemakers_functions_take_the_places_where_no_decorator_is(tmp_path):
    codes = load([write(tmp_path / "s", SAGEMAKER_LLM)], {})
    assert codes.base.sagemaker and codes.predicts
    assert said(codes.base, *FIELDS) == [f"{name} (model.py of the model)" for name in (
        "input_fn", "output_fn", "predict_fn", "model_fn")]
    both = load([write(tmp_path / "b", FORMATTERS + SAGEMAKER_LLM)], {})
    assert not both.base.sagemaker  # decorators present: DJL ignores the toolkit's names
    assert said(both.base, "prediction_handler", "init_handler") == [None, None]


def test_an_adapters_formatters_are_its_own(tmp_path):
    codes = load([write(tmp_path / "m", FORMATTERS)],
                 {"alpha": write(tmp_path / "alpha", ADAPTER_INPUT), "beta": tmp_path / "none"})
    assert list(codes.adapters) == ["alpha"]
    assert said(codes.adapters["alpha"], "input_formatter", "output_formatter") == [
        "input formatter adapter_input (model.py of LoRA adapter 'alpha')", None]


def test_a_model_py_importing_this_projects_djl_entry_is_served_as_it_is(tmp_path):
    write(tmp_path, "from handlers.djl import handle\n")
    assert load([tmp_path], {}) is None  # nothing to apply


@pytest.mark.parametrize(("text", "message"), [
    ("def handle(inputs):\n    return None\n",
     "defines handle(): DJL Serving's custom handler, which runs inside DJL Serving"),
    ("from djl_python.input_parser import input_formatter\n\n@input_formatter\ndef a(p, **k):"
     "\n    return p\n\n@input_formatter\ndef b(p, **k):\n    return p\n",
     "marks 2 functions @input_formatter: a, b; keep one"),
    ("from djl_python.input_parser import input_formatter\n\n@input_formatter\ndef a(p):\n"
     "    return p\n",
     "the input formatter a (model.py of the model) is called (x, tokenizer=...), which its "
     "signature does not take"),
    ("def input_fn(body):\n    return body\n",
     "the input_fn (model.py of the model) is called with 2 positional argument(s)"),
    ("from djl_python.input_parser import init_handler\n\n@init_handler\ndef init(d):\n"
     "    raise OSError('no weights here')\n",
     "the init handler init (model.py of the model) failed: OSError: no weights here"),
    ("from djl_python.input_parser import init_handler\n\n@init_handler\ndef init(d):\n"
     "    return 'a model'\n",
     "made a str, which has no predict(): add a prediction handler that uses it"),
])
def test_what_cannot_work_stops_startup_naming_the_file(tmp_path, text, message):
    write(tmp_path, text)
    with pytest.raises(ModelCodeError, match="model.py") as refused:
        load([tmp_path], {})
    assert str(tmp_path / "model.py") in str(refused.value)
    assert message in str(refused.value)


@pytest.mark.parametrize(("text", "where"), [
    ("import json\n\nimport no_such_module\n", "line 3 failed: ModuleNotFoundError: No module "
     "named 'no_such_module'"),
    ("def broken(:\n    pass\n", "line 1 failed: SyntaxError"),
    ("import helper\n", "line 1 failed: ZeroDivisionError: division by zero"),
])
def test_an_import_error_names_the_file_and_line(tmp_path, text, where):
    write(tmp_path, text, {"helper.py": "x = 1 / 0\n"})  # a module of its own, beside it
    with pytest.raises(ModelCodeError) as refused:
        load([tmp_path], {})
    assert str(refused.value).startswith(f"importing {tmp_path / 'model.py'}, {where}")


def test_an_adapters_model_py_holds_formatters_only(tmp_path):
    with pytest.raises(ModelCodeError, match=r"LoRA adapter 'alpha'\) holds prediction handler "
                       r"answer_each \(model.py of LoRA adapter 'alpha'\): an adapter's model.py "
                       "holds @input_formatter and @output_formatter only"):
        load([tmp_path / "m"], {"alpha": write(tmp_path / "alpha", PREDICTION_HANDLER)})


def test_two_model_py_for_the_base_model_are_refused(tmp_path):
    with pytest.raises(ModelCodeError, match="two model.py files"):
        load([write(tmp_path / "a", FORMATTERS), write(tmp_path / "b", FORMATTERS)], {})


# -- DJL's decorators without djl_python ----------------------------------------------------

# How a process without djl_python imports the files: the import blocked, as where it is absent.
WITHOUT_DJL = """
import json, sys
sys.modules["djl_python"] = None
from pathlib import Path
from handlers.djl.model_code import ModelCodeError, load
try:
    codes = load([Path(sys.argv[1])], {})
except ModelCodeError as exc:
    print(json.dumps({"error": str(exc)}))
else:
    fn = codes.base.input_formatter.call
    print(json.dumps({"whose": codes.decorators, "marked": fn.is_input_formatter,
                      "formatted": fn({"question": "q"}, tokenizer=None)}))
"""


def imported_without_djl_python(folder: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", WITHOUT_DJL, str(folder)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_without_djl_python_its_decorators_are_stood_in_for(tmp_path):
    found = imported_without_djl_python(write(tmp_path, FORMATTERS))
    assert found == {"whose": "lmi-serve's stand-in for djl_python (its decorators only)",
                     "marked": True, "formatted": {
                         "inputs": "q", "parameters": {"max_new_tokens": 4, "do_sample": False},
                         "stream": False}}


def test_without_djl_python_another_import_of_it_fails_naming_what_is_there(tmp_path):
    found = imported_without_djl_python(write(tmp_path, "from djl_python import Input\n"))
    assert found["error"].startswith(f"importing {tmp_path / 'model.py'}, line 1 failed: "
                                     "ImportError: cannot import name 'Input' from 'djl_python'")
    assert found["error"].endswith("(djl_python is not installed: only DJL's decorators can be "
                                   "imported, input_formatter, prediction_handler and "
                                   "init_handler from djl_python.input_parser, output_formatter "
                                   "from djl_python.output_formatter)")


def test_an_installed_djl_python_is_never_stood_in_for(tmp_path):
    if not DJL_PYTHON_INSTALLED and "djl_python" not in required():
        pytest.skip("needs DJL's djl_python (../shared/vendor)")
    write(tmp_path, FORMATTERS)
    check = textwrap.dedent("""
        import sys
        from pathlib import Path
        from handlers.djl.model_code import load
        codes = load([Path(sys.argv[1])], {})
        import djl_python.input_parser as parser
        print(codes.decorators, parser.__file__.endswith("djl_python/input_parser.py"),
              hasattr(parser, "ParsedInput"))
    """)
    done = subprocess.run([sys.executable, "-c", check, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["DJL's", "djl_python", "0.36.0", "True", "True"]
