"""A knowledge base for retrieval tests and benchmarks: ~150 distractor passages (varied
topics, near misses that share words with the planted fact, and templated city facts) and one
planted passage about a made-up lighthouse keeper, with paraphrased questions about it
(``tests/component/test_rag.py``, ``benchmarks/bench_rag.py``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["NEAR", "PARAPHRASES", "PLANTED", "PLANTED_ID", "TOPICS", "distractors",
           "write_jsonl"]

PLANTED_ID = "kb-planted"
PLANTED = ("Edda Kroll has tended the Varnholm lighthouse since 1998. She shares the keeper's "
           "cottage with a tame octopus called Bartholomew, which has learned to unscrew the "
           "lids of jam jars to reach the sardines she hides inside them.")

# Paraphrases of the planted fact: none repeats its sentences, and most of their words are
# not the passage's (beacon for lighthouse, mollusc for octopus, containers for jars, sea
# creature for octopus; the fifth shares only "keeper", and the distractors have keepers).
# The model averages word vectors: a query without any anchor and with a stronger pull
# elsewhere ("an eight-armed animal that twists open containers to get fish" finds the
# sardines passage first) is beyond it, and not asserted.
PARAPHRASES = [
    "Which sea creature lives with the woman who runs the Varnholm beacon?",
    "What is the name of the lighthouse keeper's pet that can open jars?",
    "Who minds the beacon on Varnholm?",
    "Who has been the keeper of the Varnholm light since the late nineties?",
    "the beacon keeper whose mollusc opens containers",
    "Which clever sea creature unscrews lids?",
]

# Distractors: varied topics, and a few that share words with the planted passage
# (lighthouses, octopuses, jam, keepers) so that matching one word is not enough.
NEAR = [
    "Lighthouses use a Fresnel lens to concentrate the light of a lamp into a beam visible "
    "for many nautical miles; the beam rotates so sailors can identify each tower.",
    "Octopuses are cephalopods with three hearts and blue blood. They change colour with "
    "chromatophores in their skin and can squeeze through any gap larger than their beak.",
    "Making strawberry jam: simmer crushed berries with sugar and lemon juice until the "
    "mixture reaches the setting point, then pour it into sterilised jars.",
    "Goalkeepers in football may handle the ball only inside their own penalty area.",
    "Sardines are small oily fish of the herring family, often sold tinned in olive oil.",
    "The cottage garden style mixes flowers, herbs and vegetables in dense informal beds.",
    "Automatic lighthouses replaced resident keepers in most countries during the 20th century.",
    "A beekeeper checks the hives in spring to see whether the queen is laying eggs.",
]

TOPICS = [
    "Photosynthesis converts light energy into chemical energy: chlorophyll absorbs red and "
    "blue light, and the plant builds glucose from carbon dioxide and water.",
    "The Treaty of Westphalia, signed in 1648, ended the Thirty Years' War in the Holy Roman "
    "Empire and the Eighty Years' War between Spain and the Dutch Republic.",
    "Sourdough bread rises thanks to a starter of wild yeast and lactic acid bacteria, which "
    "also give the crumb its sour taste.",
    "Dolphins find prey by echolocation: they emit clicks and listen for the echoes.",
    "Python's asyncio runs coroutines on an event loop; blocking calls belong in a thread.",
    "The Rust borrow checker enforces that a value has either one mutable reference or any "
    "number of shared references at a time.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
    "The mitochondrion produces most of a cell's ATP through oxidative phosphorylation.",
    "In chess, castling moves the king two squares towards a rook, which jumps over it.",
    "Impressionist painters such as Monet and Renoir painted outdoors to catch changing light.",
    "A binary search halves the interval on each step and finds an item in logarithmic time.",
    "The Great Barrier Reef off Queensland is the largest coral reef system in the world.",
    "Vaccines train the immune system by exposing it to a harmless piece of a pathogen.",
    "The French Revolution began in 1789 with the storming of the Bastille in Paris.",
    "Espresso is brewed by forcing hot water through finely ground coffee at high pressure.",
    "Jupiter is the largest planet of the solar system; its Great Red Spot is a giant storm.",
    "The violin has four strings tuned in fifths: G, D, A and E.",
    "Compound interest adds interest to the principal, so the balance grows exponentially.",
    "Tectonic plates move a few centimetres a year; their collisions raise mountain ranges.",
    "Haiku are Japanese poems of three lines with five, seven and five syllables.",
    "The Amazon rainforest produces a large share of the world's oxygen and rain.",
    "TCP guarantees ordered delivery with sequence numbers and retransmission of lost packets.",
    "A marathon is 42.195 kilometres long, a distance fixed at the 1908 London Olympics.",
    "Penguins cannot fly; their wings have evolved into flippers for swimming.",
    "The printing press of Johannes Gutenberg, around 1440, used movable metal type.",
    "Glaciers carve U-shaped valleys as they slide downhill under their own weight.",
    "Insulin, made by the pancreas, lets cells take up glucose from the blood.",
    "The Roman aqueducts carried water into cities over many kilometres by gravity alone.",
    "Cheddar cheese is named after a village in Somerset, England, with caves for ageing it.",
    "An electric motor turns because a current in a magnetic field feels a force.",
    "The Silk Road linked China with the Mediterranean for trade in silk, spices and ideas.",
    "Bamboo is a grass, and some species grow nearly a metre in a single day.",
    "The Pythagorean theorem states that a squared plus b squared equals c squared.",
    "Monsoon rains in South Asia come from seasonal winds blowing in from the ocean.",
    "A sonnet has fourteen lines; Shakespeare's rhyme abab cdcd efef gg.",
    "Bees communicate the direction of flowers to the hive with a waggle dance.",
    "Git stores snapshots of a project as commits linked to their parents.",
    "The human heart has four chambers: two atria and two ventricles.",
    "Saturn's rings are made mostly of ice particles with some rock and dust.",
    "Yoga combines breathing exercises, postures and meditation.",
    "The Nile flows north through eleven countries into the Mediterranean Sea.",
    "Blockchains append blocks of transactions, each holding the hash of the previous one.",
    "Olive oil is pressed from the fruit of olive trees grown around the Mediterranean.",
    "The speed of light in vacuum is about 299,792 kilometres per second.",
    "Tea comes from the leaves of Camellia sinensis; green and black tea differ in oxidation.",
    "Volcanoes erupt when magma from the mantle rises through cracks in the crust.",
    "The Renaissance began in Florence in the 14th century with a revival of classical art.",
    "Wind turbines convert the kinetic energy of moving air into electricity.",
    "A haircut with clippers starts with a longer guard and moves to shorter ones.",
    "The tango originated in the working-class neighbourhoods of Buenos Aires.",
    "Antibiotics kill bacteria but have no effect on viruses.",
]

PLACES = ["Lisbon", "Osaka", "Quito", "Tallinn", "Nairobi", "Hobart", "Tromsø", "Cusco",
          "Marrakesh", "Winnipeg", "Bergen", "Hanoi"]
THINGS = [("bakery", "sells rye loaves and cinnamon rolls every morning"),
          ("tram line", "climbs the hill to the old castle every ten minutes"),
          ("museum", "shows textiles woven over three centuries"),
          ("football club", "plays its home games in a stadium by the river"),
          ("market", "opens on Saturdays with farmers selling cheese and honey"),
          ("university", "is known for its research on glaciers and climate"),
          ("orchestra", "performs a free concert in the park each summer"),
          ("library", "lends bicycles as well as books to its members"),
          ("harbour", "handles container ships and a ferry to the nearby islands"),
          ("festival", "fills the streets with paper lanterns in the autumn")]


def distractors() -> list[tuple[str, str, str]]:
    """~150 (id, title, text) passages: hand-written topics and near misses, plus city facts
    made from a template."""
    out = [(f"topic-{n}", "", text) for n, text in enumerate(TOPICS)]
    out += [(f"near-{n}", "", text) for n, text in enumerate(NEAR)]
    rng = random.Random(7)
    for n, place in enumerate(PLACES):
        for thing, fact in rng.sample(THINGS, 8):
            out.append((f"city-{n}-{thing.replace(' ', '-')}", place,
                        f"The {thing} of {place} {fact}."))
    return out


def write_jsonl(path: Path, planted: bool = True) -> Path:
    rows = [{"id": ident, "title": title, "text": text} if title else {"id": ident, "text": text}
            for ident, title, text in distractors()]
    if planted:
        rows.insert(len(rows) // 2, {"id": PLANTED_ID, "title": "Varnholm", "text": PLANTED})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path
