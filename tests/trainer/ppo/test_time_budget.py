"""``trainer.time_budget_minutes``: the loop stops before a step would overrun the budget."""

from hybridflow.trainer.ppo.ray_trainer import out_of_time


def test_stops_when_one_more_mean_step_would_overrun():
    assert not out_of_time(elapsed_s=50.0, steps_done=5, budget_s=60.0)  # 50 + 10 = 60: still fits
    assert out_of_time(elapsed_s=51.0, steps_done=5, budget_s=60.0)  # 51 + 10.2 > 60
    assert out_of_time(elapsed_s=70.0, steps_done=1, budget_s=60.0)


def test_never_stops_before_the_first_step():
    assert not out_of_time(elapsed_s=0.0, steps_done=0, budget_s=0.0)
