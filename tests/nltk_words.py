"""nltk data for TextArena's word games, made here: textarena's Wordle, Hangman, WordLadder ... read nltk's
`words` corpus and tag each word with nltk's averaged perceptron tagger (`averaged_perceptron_tagger_eng`), both
downloaded from GitHub on first use, which the test machines cannot reach. `build(root)` writes a small `words`
corpus (`en`, `en-basic`) and a perceptron tagger trained by nltk's own `PerceptronTagger.train` on the same
words (nouns tagged NN), in nltk's file layout, so the games and verifiers' `textarena` taskset run unchanged
with `root` on NLTK_DATA."""

from __future__ import annotations

from pathlib import Path

# nouns, most of five letters (Wordle's secret is a five-letter NN of `en-basic`; Hangman's any word of it), and a
# few words of other tags
NOUNS = ["apple", "bread", "chair", "cloud", "heart", "horse", "house", "light", "money", "music", "night",
         "paper", "plant", "river", "smile", "stone", "sugar", "table", "train", "water", "cat", "book", "garden",
         "kitchen", "mountain"]
OTHERS = [("run", "VB"), ("go", "VB"), ("blue", "JJ"), ("quickly", "RB")]
TAGGER = "averaged_perceptron_tagger_eng"
# the test session's nltk data folder, first on NLTK_DATA for it and its Ray workers (set by conftest's ray_session)
FOLDER: Path | None = None


def build(root: Path) -> Path:
    """Write the corpus and the tagger under `root` (an nltk data folder); `root`."""
    import nltk
    from nltk.tag.perceptron import PerceptronTagger

    words = root / "corpora" / "words"
    words.mkdir(parents=True, exist_ok=True)
    listed = "\n".join([*NOUNS, *(w for w, _ in OTHERS)]) + "\n"
    for name in ("en", "en-basic"):
        (words / name).write_text(listed)
    (words / "README").write_text("Test words for TextArena's word games (tests/nltk_words.py).\n")
    tagger_dir = root / "taggers" / TAGGER
    tagger_dir.mkdir(parents=True, exist_ok=True)
    added = str(root) not in nltk.data.path
    if added:  # nltk writes a model only under one of its data folders
        nltk.data.path.insert(0, str(root))
    try:
        tagger = PerceptronTagger(load=False)
        tagger.train([[(w, "NN")] for w in NOUNS] + [[pair] for pair in OTHERS], nr_iter=5)
        tagger.save_to_json(lang="eng", loc=str(tagger_dir))
    finally:
        if added:
            nltk.data.path.remove(str(root))
    return root
