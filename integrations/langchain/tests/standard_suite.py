"""What the standard-suite modules (demo model and capable model) share."""

from __future__ import annotations

# langchain-tests loads with allowed_objects="all", which admits only the partner classes of
# langchain-core's own list: any package outside it is refused, whatever it implements. Loading
# with the class named (allowed_objects=[ChatDynGen], how a user loads an outside class) passes:
# test_langchain_construction.py::test_objects_serialize_without_their_folder_and_load_back.
SERDES_ALLOWLIST = (
    "langchain-core's allowed_objects='all' admits only its own list of partner classes; "
    "ChatDynGen serializes and loads with allowed_objects=[ChatDynGen]"
)
