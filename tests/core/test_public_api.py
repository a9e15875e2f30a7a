"""The package's public surface: every error and every protocol class is importable from plugrt."""

from __future__ import annotations

import inspect

import plugrt
from plugrt import errors, provider


def test_every_public_error_is_exported_from_plugrt():
    missing = sorted(set(errors.__all__) - set(plugrt.__all__))
    assert missing == []


def test_every_protocol_class_and_version_is_exported_from_plugrt():
    public = {
        name
        for name in provider.__all__
        if inspect.isclass(getattr(provider, name)) or name.isupper() and "VERSION" in name
    }
    assert public, "provider.__all__ names no class"
    assert sorted(public - set(plugrt.__all__)) == []


def test_every_name_in_all_resolves_to_the_same_object():
    for name in plugrt.__all__:
        assert hasattr(plugrt, name), name
    for name in errors.__all__:
        assert getattr(plugrt, name) is getattr(errors, name)
    assert len(plugrt.__all__) == len(set(plugrt.__all__)), "a name is listed twice"


def test_every_error_class_defined_in_errors_is_listed_in_its_all():
    defined = {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, errors.PlugrtError) and obj.__module__ == errors.__name__
    }
    assert "PlugrtError" in defined
    assert sorted(defined - set(errors.__all__)) == []
