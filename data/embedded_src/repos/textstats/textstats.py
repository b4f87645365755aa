"""Small statistics over plain text: words, sentences, frequencies."""

PUNCTUATION = ".,;:!?\"'()"
SENTENCE_ENDS = ".!?"


def words(text):
    """Lower-case words with surrounding punctuation removed."""
    result = []
    for raw in text.split():
        word = raw.strip(PUNCTUATION).lower()
        if word:
            result.append(word)
    return result


def word_count(text):
    return len(words(text))


def unique_words(text):
    """Distinct words in order of first appearance."""
    seen = []
    for word in words(text):
        if word not in seen:
            seen.append(word)
    return seen


def word_frequencies(text):
    counts = {}
    for word in words(text):
        counts[word] = counts.get(word, 0) + 1
    return counts


def top_words(text, n=3):
    """The n most frequent words, ties broken alphabetically."""
    counts = word_frequencies(text)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return [word for word, _ in ranked[:n]]


def average_word_length(text):
    items = words(text)
    if not items:
        return 0.0
    total = sum(len(word) for word in items)
    return round(total / len(items), 2)


def longest_word(text):
    """The longest word; the first one wins a tie. Empty text gives ''."""
    best = ""
    for word in words(text):
        if len(word) > len(best):
            best = word
    return best


def sentence_count(text):
    """Count sentence-ending marks; a run like '?!' counts once."""
    count = 0
    previous_end = False
    for char in text:
        is_end = char in SENTENCE_ENDS
        if is_end and not previous_end:
            count += 1
        previous_end = is_end
    return count


def char_count(text, include_spaces=True):
    if include_spaces:
        return len(text)
    return len(text.replace(" ", ""))


def vowel_ratio(text):
    """Share of letters that are vowels, rounded to 2 places."""
    letters = [c for c in text.lower() if c.isalpha()]
    if len(letters) == 0:
        return 0.0
    vowels = sum(1 for c in letters if c in "aeiou")
    return round(vowels / len(letters), 2)


def is_palindrome(text):
    cleaned = [c for c in text.lower() if c.isalnum()]
    return cleaned == cleaned[::-1]


def capitalize_words(text):
    return " ".join(word[:1].upper() + word[1:] for word in text.split(" "))


def truncate(text, limit, suffix="..."):
    """Cut text to at most `limit` characters, ending with suffix when cut."""
    if len(text) <= limit:
        return text
    keep = limit - len(suffix)
    if keep < 0:
        keep = 0
    return text[:keep] + suffix
