"""Property tests: over random add / step / fork / truncate / abort sequences, the paged
allocator never gives a block to two owners (except shared forks, tracked by refcount) and
never leaks one."""

from hypothesis import given, settings
from hypothesis import strategies as st

from lmstack.components.paged import PagedAllocator
from lmstack.testing.allocator import check_invariants
from lmstack.testing.fakes import make_seq

ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "step", "fork", "truncate", "abort"]),
        st.integers(0, 10_000),
        st.integers(1, 40),
    ),
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 40), block_size=st.sampled_from([1, 2, 3, 16]))
def test_no_double_ownership_no_leak(ops, num_blocks, block_size):
    alloc = PagedAllocator(num_blocks, block_size)
    live = []
    for op, pick, n in ops:
        if op == "add" or not live:
            seq = make_seq(n)
            if alloc.can_allocate(seq, n):
                alloc.allocate(seq, n)
                seq.num_computed_tokens = n
                live.append(seq)
            else:
                assert alloc.num_free_blocks() < -(-n // block_size)
        elif op == "step":
            seq = live[pick % len(live)]
            k = 1 + n % 4
            if alloc.can_allocate(seq, k):
                copies = alloc.allocate(seq, k)
                # Copy-on-write targets are fresh blocks owned by this sequence alone.
                for _, dst in copies:
                    assert alloc.refcount(dst) == 1 and dst in alloc.block_table(seq)
                seq.token_ids += [5] * k
                seq.num_computed_tokens += k
        elif op == "fork":
            parent = live[pick % len(live)]
            child = make_seq(1)
            child.token_ids = list(parent.token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            alloc.fork(parent, child)
            live.append(child)
        elif op == "truncate":
            seq = live[pick % len(live)]
            keep = pick % (seq.num_computed_tokens + 1)
            alloc.truncate(seq, keep)
            seq.num_computed_tokens = keep
        else:
            alloc.free(live.pop(pick % len(live)))
        check_invariants(alloc, live)
    for seq in live:
        alloc.free(seq)
    check_invariants(alloc, [])
    assert alloc.num_free_blocks() == num_blocks
