"""A fixed, seeded prompt set: "Write a long essay about <topic>. ..." prompts of about 95
prompt tokens each once wrapped in SmolLM2's chat template (the reference workload)."""

from __future__ import annotations

import random

__all__ = ["TOPICS", "WORDS", "make_prompts"]

TOPICS = (
    "the history of bridges", "ocean currents", "the printing press", "coffee farming",
    "migratory birds", "the invention of the telescope", "medieval castles", "volcanoes",
    "the silk road", "honey bees", "glass making", "the water cycle", "ancient libraries",
    "railway networks", "desert ecosystems", "the history of maps", "lighthouses",
    "paper money", "mountain glaciers", "the science of sleep", "public parks",
    "the origins of chess", "tea ceremonies", "coral reefs", "windmills", "clock making",
    "the first airplanes", "rice cultivation", "city planning", "the human heart",
    "solar eclipses", "river deltas",
)

WORDS = (
    "people", "history", "way", "art", "world", "information", "map", "family", "system",
    "music", "science", "nature", "knowledge", "power", "language", "water", "food",
    "city", "village", "market", "river", "mountain", "forest", "season", "winter",
    "summer", "journey", "travel", "trade", "craft", "tool", "machine", "energy", "light",
    "time", "change", "growth", "design", "story", "culture", "tradition", "school",
    "teacher", "student", "book", "letter", "road", "bridge", "house", "garden", "field",
    "farm", "harvest", "weather", "storm", "wind", "stone", "metal", "wood", "fire",
    "island", "coast", "harbor", "ship", "sailor", "merchant", "king", "queen", "worker",
    "builder", "engineer", "doctor", "medicine", "health", "animal", "bird", "fish",
    "insect", "plant", "flower", "tree", "seed", "soil", "sky", "star", "planet", "moon",
    "sun", "morning", "evening", "night", "memory", "idea", "question", "answer", "reason",
    "problem", "solution", "future", "past", "present", "community", "friendship", "work",
)


def make_prompts(n: int, seed: int = 0, num_words: int = 41) -> list[str]:
    """`n` distinct prompts, the same for the same (n, seed, num_words).

    Each names a topic, then asks to cover `num_words` seeded random words (41 words: about
    95 prompt tokens with SmolLM2's chat template). Prompts differ from their sixth word
    on, so prefix caching shares little more than the chat template between them."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        topic = TOPICS[(i + seed) % len(TOPICS)]
        words = " ".join(rng.choice(WORDS) for _ in range(num_words))
        prompts.append(f"Write a long essay about {topic} (essay {i + 1}). "
                       f"Cover each of these words in turn: {words}.")
    return prompts
