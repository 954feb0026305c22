"""The drafter's feed (runtime/drafter_feed.py): pairs wait until the drafter is next needed, and of
a long run only the last context_rows are observed, the older ones skipped."""
import numpy as np

from hybrid_npu.runtime.drafter_feed import FLUSH_AT, HOLD_BACK, DrafterFeed, feed_for


def pairs(n, start=0, width=3):
    tokens = list(range(start, start + n))
    return tokens, np.arange(start * width, (start + n) * width, dtype=np.float32).reshape(n, width)


def test_the_feed_keeps_the_last_pairs_in_order_and_counts_the_rest():
    feed = DrafterFeed(keep=5)
    feed.add(*pairs(3))
    for t in range(3, 15):  # plain decode steps, one pair each: held within 2 x keep
        feed.add(*pairs(1, t), decoded=True)
        assert len(feed._tokens) <= 10
    assert len(feed) == 15 and feed.decoded == 12
    skipped, tokens, features = feed.take()
    assert skipped == 10 and tokens == list(range(10, 15))
    assert np.array_equal(features, pairs(5, 10)[1])
    assert len(feed) == 0 and feed.decoded == 0 and feed.take()[:2] == (0, [])


def test_a_feed_for_a_drafter_that_cannot_skip_keeps_every_pair():
    class Observer:  # reset/observe/propose only
        pass

    feed = feed_for(Observer())
    assert feed.keep is None
    feed.add(*pairs(700))
    skipped, tokens, _ = feed.take()
    assert skipped == 0 and tokens == list(range(700))


def test_a_drafter_that_cannot_skip_is_shown_a_long_run_as_it_grows_and_in_order():
    """A long plain run is not held whole for a drafter that reads every row: past FLUSH_AT the older
    pairs are observed, and observed + taken is every pair once, in order."""
    class Observer:
        def __init__(self):
            self.tokens, self.features = [], []

        def observe(self, tokens, features):
            self.tokens += tokens
            self.features.append(features)

    owner = Observer()
    feed = feed_for(owner)
    n = 3 * FLUSH_AT + 17
    for t in range(n):
        feed.add(*pairs(1, t), decoded=True)
        assert len(feed._tokens) <= FLUSH_AT
    assert len(owner.tokens) >= 2 * FLUSH_AT and HOLD_BACK <= feed.decoded == len(feed._tokens)
    skipped, tokens, features = feed.take()
    assert skipped == 0 and owner.tokens + tokens == list(range(n))
    assert np.array_equal(np.concatenate(owner.features + [features]), pairs(n)[1])


def test_pairs_given_as_tap_parts_are_taken_as_the_joined_features_in_order():
    """A plain step hands its taps unjoined (a tuple of [1, w_j] parts); mixed with whole blocks, kept
    through trims, the feed gives what joining each at once would have given."""
    widths = (2, 3, 1)

    def parts(n, start):  # the parts of pairs(n, start, width=6), column blocks of 2, 3 and 1
        whole = pairs(n, start, width=6)[1]
        return tuple(np.split(whole, np.cumsum(widths)[:-1], axis=1))

    for keep in (None, 4, 7):
        feed = DrafterFeed(keep=keep)
        feed.add(*pairs(3, 0, width=6))  # a prompt's block
        for t in range(3, 12):
            feed.add([t], parts(1, t), decoded=True)
        feed.add(*pairs(2, 12, width=6))  # a round's path
        feed.add([14], parts(1, 14), decoded=True)
        skipped, tokens, features = feed.take()
        assert tokens == list(range(skipped, 15))
        assert np.array_equal(features, pairs(15, 0, width=6)[1][skipped:])
        assert skipped == (0 if keep is None else 15 - keep)
