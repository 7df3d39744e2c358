"""Multi-turn episodes: tools the model calls and environments it acts in (floor 4: above the
rewards, which score whole episodes, and below the data and training floors that run them)."""
