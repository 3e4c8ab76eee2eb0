# A reward function for a conversational dataset, written the way TRL's documentation writes them
# (completions are lists of messages; the text is completion[0]["content"]). Not an echo2 API.


def reward_len_chat(completions, **kwargs):
    return [-abs(20 - len(completion[0]["content"])) for completion in completions]
