"""Environments written as TRL's docs write them for GRPOTrainer(environment_factory=...), for the
tests that rlnotes reads them as TRL does (rollout.env=tests.trl_environments:Class).

Each keeps the interface of TRL's example as its docs show it (class and method names, the
signatures with their type hints, reset(**kwargs), the Google-style docstrings with Args: and
Returns:, get_reward), in our own words: TRL's code is not copied here. What a TRL example does
over the network is done in process (there is no network here).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EchoObservation:
    echoed_message: str
    reward: float


class LocalEcho:
    """Stands in for OpenEnv's echo client: it says the message back, rewarded 0.1 a character."""

    def step(self, message: str) -> EchoObservation:
        return EchoObservation(echoed_message=message, reward=0.1 * len(message))


class MyEchoEnv:
    """TRL's echo example (examples/scripts/openenv/echo.py as environment_factory came in, in TRL
    1.x): its one tool is named `step`, which rlnotes took for a gym step before rollout.env_style."""

    def __init__(self):
        self.env = LocalEcho()

    def reset(self, **kwargs) -> None | str:
        self._reward = None
        return None

    def step(self, message: str) -> str:
        """
        Send a message to the environment, which says it back.

        Args:
            message: What the environment should say back

        Returns:
            What the environment said.
        """
        observation = self.env.step(message)
        self._reward = observation.reward
        return observation.echoed_message

    def get_reward(self) -> float:
        """
        The reward of the last message sent.

        Returns:
            The reward.
        """
        return self._reward


class IncrementEnv:
    """TRL's counter example with an external dataset (its GRPO docs, "Providing an external
    dataset"): the row's `target` column reaches reset as a keyword, `increment` is the tool, and
    get_reward scores the episode from the environment's own state."""

    def reset(self, target, **kwargs) -> None:
        self.counter = 0
        self.target = target

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Add to the counter.

        Args:
            step: How much to add to the counter.

        Returns:
            The counter after the addition.
        """
        self.counter += step
        return self.counter


class CounterResetEnv:
    """TRL's first counter example (its GRPO docs as environment_factory came in): reset's string is
    appended to the last user message before generation."""

    def reset(self, **kwargs) -> str | None:
        self.counter = 0
        return "Counter reset to 0.\n"

    def increment(self, step: int) -> int:
        """
        Add to the counter.

        Args:
            step: How much to add to the counter.

        Returns:
            The counter after the addition.
        """
        self.counter += step
        return self.counter


def counter_reward(environments, **kwargs) -> list[float]:
    """A reward function reading each episode's environment, as TRL's docs score an environment
    without get_reward (here CounterResetEnv's counter)."""
    return [float(env.counter) for env in environments]
