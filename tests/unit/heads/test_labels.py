"""Right labels: every head records what its labels mean. The label space in process; end
to end, a head agent and ``edgepfl predict`` printing those names:
tests/integration/agent/test_labels_end_to_end.py.
"""

from __future__ import annotations

import pytest

from edgepfl.heads.labels import FEDERATION, LOCAL, LabelSpace, label_space_for

# ----------------------------------------------------------------- the rule, without any model


def test_a_subset_of_the_federations_classes_joins_its_numbering_whatever_the_folder_order():
    space, index = label_space_for(["Sandal", "Trouser"], ["T-shirt", "Trouser", "Pullover", "Dress", "Coat", "Sandal"])
    assert space.kind == FEDERATION and space.names[1] == "Trouser"
    assert index.tolist() == [5, 1]  # local 0 ("Sandal", sorted first) is federation class 5
    assert space.column_names([1, 5]) == ["Trouser", "Sandal"]


def test_unknown_classes_make_a_new_task_in_their_own_numbering():
    space, index = label_space_for(["cat", "dog"], ["0", "1", "2"])
    assert space == LabelSpace(("cat", "dog"), LOCAL) and index.tolist() == [0, 1]
    # unnamed local data is a partition of the federation's pool
    space, index = label_space_for([], ["a", "b"])
    assert space.kind == FEDERATION and index.tolist() == [0, 1]


def test_a_label_without_a_name_is_an_error():
    with pytest.raises(ValueError, match="no name"):
        LabelSpace(("a", "b"), LOCAL).column_names([0, 2])
