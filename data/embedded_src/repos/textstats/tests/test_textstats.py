from textstats import (
    average_word_length,
    capitalize_words,
    char_count,
    is_palindrome,
    longest_word,
    sentence_count,
    top_words,
    truncate,
    unique_words,
    vowel_ratio,
    word_count,
    word_frequencies,
    words,
)


def test_words_strip_punctuation():
    assert words("Hello, world!") == ["hello", "world"]


def test_words_drop_pure_punctuation():
    assert words("a - b") == ["a", "-", "b"]
    assert words("a ... b") == ["a", "b"]


def test_word_count():
    assert word_count("one two  three") == 3


def test_word_count_empty():
    assert word_count("") == 0


def test_unique_words_order():
    assert unique_words("b a b c a") == ["b", "a", "c"]


def test_word_frequencies():
    assert word_frequencies("a b a") == {"a": 2, "b": 1}


def test_top_words():
    assert top_words("x y y z z z", 2) == ["z", "y"]


def test_top_words_tie_alphabetical():
    assert top_words("b a c", 2) == ["a", "b"]


def test_top_words_default_three():
    assert len(top_words("a b c d e")) == 3


def test_average_word_length():
    assert average_word_length("ab abcd") == 3.0


def test_average_word_length_rounding():
    assert average_word_length("a bb bb") == 1.67


def test_average_word_length_empty():
    assert average_word_length("") == 0.0


def test_longest_word():
    assert longest_word("a quick fox") == "quick"


def test_longest_word_tie_first():
    assert longest_word("cat dog") == "cat"


def test_longest_word_empty():
    assert longest_word("") == ""


def test_sentence_count():
    assert sentence_count("Hi. How are you? Fine!") == 3


def test_sentence_count_runs():
    assert sentence_count("What?! Really...") == 2


def test_sentence_count_none():
    assert sentence_count("no end") == 0


def test_char_count_with_spaces():
    assert char_count("a b c") == 5


def test_char_count_without_spaces():
    assert char_count("a b c", include_spaces=False) == 3


def test_vowel_ratio():
    assert vowel_ratio("abcd") == 0.25


def test_vowel_ratio_no_letters():
    assert vowel_ratio("123") == 0.0


def test_is_palindrome():
    assert is_palindrome("A man, a plan, a canal: Panama")


def test_is_not_palindrome():
    assert not is_palindrome("hello")


def test_capitalize_words():
    assert capitalize_words("hello big world") == "Hello Big World"


def test_capitalize_keeps_rest():
    assert capitalize_words("mcDonald") == "McDonald"


def test_truncate_short_text():
    assert truncate("hello", 10) == "hello"


def test_truncate_exact_limit():
    assert truncate("hello", 5) == "hello"


def test_truncate_cut():
    assert truncate("hello world", 8) == "hello..."


def test_truncate_tiny_limit():
    assert truncate("hello", 2) == "..."
