"""tests/support/backendops.py's reading of test-backend-ops' console output, both modes.

The lines are in the format of the tool's console printer (tests/test-backend-ops.cpp,
``console_printer::print_operation``): "  OP(params): " then the status, OK/FAIL in ANSI colour.
"""

from tests.support.backendops import parse_cases

OK = "\x1b[1;32mOK\x1b[0m"
FAIL = "\x1b[1;31mFAIL\x1b[0m"


def _line(case: str, status: str) -> str:
    return f"  {case}: {status}"


def test_test_mode_one_line_per_case():
    text = "\n".join([
        "Testing 1 devices", "",
        _line("ADD(type=f32,ne=[1,1,8,1],nr=[32,1,1,1])", OK),
        "[ADD] NMSE = 0.1 > 0.0000001 " + _line("ADD(type=f32,ne=[16,5,4,3])", FAIL),
        _line("ADD(type=bf16,ne=[4,4,1,1])", "not supported [RPC0] "),
    ])
    assert parse_cases(text) == [("ADD(type=f32,ne=[1,1,8,1],nr=[32,1,1,1])", "ok"),
                                 ("ADD(type=f32,ne=[16,5,4,3])", "fail"),
                                 ("ADD(type=bf16,ne=[4,4,1,1])", "not_supported")]


def test_grad_mode_pairs_the_start_line_with_the_result():
    a, b, c, d, e = (f"SILU(type=f32,ne=[{n},5,4,3],v=0)" for n in range(1, 6))
    text = "\n".join([
        _line(a, "not supported [a->type != FP32]"),  # early: the only line of the case
        _line(b, OK), _line(b, OK),  # started, then passed
        _line(c, OK), _line(c, "[SILU] MAA = 0.500000000 > 0.000100000 compare failed " + FAIL),
        _line(d, OK), _line(d, "skipping large tensors for speed "),
        _line(e, OK), _line(e, "[SILU] nonfinite gradient at index 3 (RPC0=nan) compare failed " + FAIL),
    ])
    assert parse_cases(text, "grad") == [(a, "not_supported"), (b, "ok"), (c, "fail"), (d, "skipped"),
                                         (e, "fail")]


def test_grad_mode_the_result_is_named_after_the_summed_loss():
    # eval_grad sums a non-scalar output (ggml_sum) and prints the result under the sum's name
    a, b = "ADD(type=f32,ne=[10,5,4,3],nr=[2,1,1,1])", "ADD(type=f32,ne=[1,1,1,1],nr=[32,1,1,1])"
    text = "\n".join([_line(a, OK), _line("SUM" + a[3:], OK),
                      _line(b, OK), _line("SUM" + b[3:], "not supported [RPC0]")])
    assert parse_cases(text, "grad") == [(a, "ok"), (b, "not_supported")]


def test_grad_mode_a_failed_case_prints_two_fail_lines():
    # as test-backend-ops b11434 prints a permuted SUM whose gradient is off
    a = "SUM(type=f32,ne=[33,256,1,1],permute=[1,0,2,3])"
    b = "SUM(type=f32,ne=[33,1,1,1])"
    text = "\n".join([_line(a, OK), _line(a, "[SUM] MAA = 0.996977786 > 0.000100000 " + FAIL),
                      _line(a, "compare failed " + FAIL), _line(b, OK), _line(b, OK)])
    assert parse_cases(text, "grad") == [(a, "fail"), (b, "ok")]


def test_grad_mode_a_case_still_running_is_not_finished():
    a, b = "SUM(type=f32,ne=[10,5,4,3])", "SUM(type=f32,ne=[33,1,1,1])"
    text = "\n".join([_line(a, OK), _line(a, OK), _line(b, OK)])  # the process died during b
    assert parse_cases(text, "grad") == [(a, "ok")]


def test_grad_mode_a_case_that_returned_without_its_result_is_a_fail():
    # eval_grad returns false after a failed compute without printing the result line
    a, b = "SUM(type=f32,ne=[10,5,4,3])", "SUM(type=f32,ne=[33,1,1,1])"
    text = "\n".join([_line(a, OK), "ggml_backend_graph_compute failed", _line(b, OK), _line(b, OK)])
    assert parse_cases(text, "grad") == [(a, "fail"), (b, "ok")]


def test_the_same_output_read_whole_and_with_trailing_text():
    a = "EXP(type=f32,ne=[10,5,4,3])"
    text = "\n".join([_line(a, OK), _line(a, OK)])
    assert parse_cases(text + "\n  2/2 tests passed\n", "grad") == parse_cases(text, "grad") == [(a, "ok")]
