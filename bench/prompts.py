"""The benchmark's fixed prompts: ChatML text in SmolLM2's chat template, ~64 tokens each.

The text is built here rather than with the tokenizer's `apply_chat_template`, so the client
needs no tokenizer and every run sends byte-identical prompts.
"""

from __future__ import annotations

# SmolLM2's default system message plus one sentence, to bring the prompts to ~64 tokens.
SYSTEM = (
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face. "
    "Answer clearly and briefly."
)

QUESTIONS = (
    "Explain in simple words why the sky looks blue during the day but turns red and orange "
    "when the sun is setting in the evening.",
    "I am planning a small vegetable garden on my balcony this spring. Which plants grow well "
    "in pots and need only a few hours of sun?",
    "What are the main differences between a list and a tuple in Python, and when should a "
    "beginner prefer one over the other in real code?",
    "Write a short and friendly note to a neighbour asking them to water my plants while I am "
    "away on holiday for the next two weeks.",
    "How does a refrigerator keep food cold? Please describe the basic cycle of the refrigerant "
    "without using too much technical language.",
    "Give me three ideas for a fun weekend activity with two children aged six and nine when the "
    "weather is rainy and we have to stay home.",
    "Why do people say that breakfast is the most important meal of the day, and is there any "
    "good evidence that this saying is actually true?",
    "Describe the water cycle for a school project, covering evaporation, condensation and "
    "precipitation, in a way a ten year old understands.",
    "What should I consider when choosing my first pair of running shoes if I want to start "
    "jogging three times a week in the city park?",
    "Summarise the story of Little Red Riding Hood in a few sentences and tell me what lesson "
    "the tale was originally meant to teach children.",
    "How can I improve my sleep when I keep waking up in the middle of the night and find it "
    "hard to fall asleep again before the morning?",
    "Explain what a budget is and suggest a simple way for a student to track monthly spending "
    "on food, transport and entertainment.",
    "What is the difference between weather and climate? Please use one or two everyday "
    "examples so that the explanation is easy to remember.",
    "I want to learn to play the guitar as an adult with a busy job. How many minutes a day "
    "should I practise, and what should I start with?",
    "Tell me how bees make honey, from collecting nectar from flowers to storing the finished "
    "honey inside the wax cells of their hive.",
    "Which simple habits help people stay focused while working from home, especially when "
    "there are many distractions around the house?",
    "Explain how a bicycle stays upright while it is moving, and why it is much harder to "
    "balance when the bicycle is standing completely still.",
    "Suggest a healthy lunch that I can prepare in fifteen minutes using rice, eggs, some "
    "vegetables and whatever spices most kitchens already have.",
    "What is photosynthesis, and why is it so important for animals and people even though "
    "only plants, algae and some bacteria can do it?",
    "How do I politely decline an invitation to a party from a colleague without hurting their "
    "feelings or making the situation awkward at work?",
    "Describe the main parts of a computer, such as the processor, the memory and the storage, "
    "and explain what each part does in simple terms.",
    "Why do cats purr? Is it always a sign that they are happy, or can purring also mean "
    "something else about how the cat is feeling?",
    "Give me a short plan for learning basic Spanish in three months, with about thirty minutes "
    "of study on most days of the week.",
    "What causes the seasons on Earth? Many people think it is the distance to the sun, so "
    "please explain why that common idea is wrong.",
    "How should I prepare for a job interview at a small company where I would work in customer "
    "support, and what questions might they ask me?",
    "Explain what recycling really achieves for the environment and which household items are "
    "usually the most worthwhile to separate and recycle.",
    "Write a short poem of four lines about a quiet morning by a lake, with mist over the water "
    "and birds starting to sing in the trees.",
    "What is the difference between a virus and a bacterium, and why do antibiotics help "
    "against one of them but not against the other?",
    "How can I keep my houseplants alive during winter when the heating makes the air in the "
    "flat very dry and there is little daylight?",
    "Explain why the moon shows different shapes during the month, from new moon to full moon, "
    "and how long one full cycle of phases takes.",
    "Give me some tips for writing a clear email to my manager asking for a day off next week "
    "to attend a family event in another town.",
    "Why is it a good idea to drink water regularly during the day, and how can I tell whether "
    "I am drinking enough without counting every glass?",
)


def chat_prompt(question: str, system: str = SYSTEM) -> str:
    """One user turn in SmolLM2's ChatML template, ready for the assistant's answer."""
    return (
        f"<|im_start|>system\n{system}<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def prompt(index: int) -> str:
    """The `index`-th benchmark prompt (cycling through the fixed questions)."""
    return chat_prompt(QUESTIONS[index % len(QUESTIONS)])


# Plain words for long prompts of a chosen token count (~one token each in SmolLM2's tokenizer).
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "wise", "owls", "count", "silver", "stars", "above", "quiet", "hills", "and", "rivers")


def words(count: int, offset: int = 0) -> str:
    """`count` words cycling through WORDS from its `offset`-th: prompts of different offsets
    share no prefix."""
    return " ".join(WORDS[(i + offset) % len(WORDS)] for i in range(count))
