"""What several commands share: the command line's parser (its one spelling rule for options), a training
job's arguments, the runconfig overrides they make, and output as JSON or aligned lines."""
import argparse
import json
# What a command runs (pyapi.job, pyapi.params, wse_core, data_tools, ...) is imported inside its function:
# `wse --help` imports every module here and must load no numerics (tests/test_cli.py).


class Parser(argparse.ArgumentParser):
    """The parser of `wse` and of every subcommand (argparse makes a subcommand's parser of its parent's
    class, so the commands plugged in, `wse bench`, follow the same rules).

    One spelling rule: an option of several words is declared, and shown in help, with underscores
    (``--num_csx``, as the params keys it overrides and the docs write it), and is taken with hyphens
    too (``--num-csx``, as most command lines spell theirs). The other spelling is known to the parser
    but not listed, so help shows each option once and its errors name the option as declared. (The rule
    is applied by the parser's add_argument: an option added through an argument group would escape it;
    no command has one.)

    A mistyped choice is answered with the closest one (`wse fitt`: did you mean fit?) rather than the
    list of all. (Python 3.14's ``suggest_on_error`` does this; we support 3.10.)"""

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        for name in action.option_strings:
            for other in _spellings(name) - set(action.option_strings):
                if other in self._option_string_actions:  # as argparse refuses two options of one name
                    raise argparse.ArgumentError(action, f"conflicting option string: {other} (the other spelling "
                                                         f"of {name}, which the parser takes already)")
                self._option_string_actions[other] = action  # parsed, not listed in help
        return action

    def _get_option_tuples(self, option_string):
        # An abbreviation both spellings of one option start with (--num: --num_csx, --num-csx) is that
        # option, as it was before the second spelling was taken, not an ambiguity.
        matches, seen = [], set()
        for match in super()._get_option_tuples(option_string):
            if match[0] not in seen:
                seen.add(match[0])
                matches.append(match)
        return matches

    def _check_value(self, action, value):
        if action.choices is not None and value not in action.choices:
            from wse_core.checks import did_you_mean

            raise argparse.ArgumentError(action, f"invalid choice: {value!r} "
                                                 f"({did_you_mean(value, list(action.choices))})")

    def chosen(self, args):
        """The parser of the command ``args`` names, down to its action (`wse checkpoint info`): a mistake
        in its arguments is answered with its usage, not the top level's."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
                return action.choices[getattr(args, action.dest)].chosen(args)
        return self


def _spellings(name):
    """A long option's spellings under the rule: ``--num_csx`` and ``--num-csx``; a short option's, itself."""
    if not name.startswith("--"):
        return {name}
    words = name[2:]
    return {"--" + words.replace("-", "_"), "--" + words.replace("_", "-")}


#: What a command that takes a params file takes (pyapi.params.params_file).
PARAMS_HELP = "params YAML file, or a run's model_dir (the params it ran with)"


def job_args(parser, model_dir=True):
    """What every command that takes a training job takes: PARAMS and the overrides of its runconfig."""
    parser.add_argument("params", metavar="PARAMS", help=PARAMS_HELP)
    parser.add_argument("--num_csx", type=int, metavar="N", help="override runconfig.num_csx")
    parser.add_argument("--execution_strategy", choices=["weight_streaming", "pipeline", "auto"],
                        help="override runconfig.execution_strategy")
    if model_dir:
        parser.add_argument("--model_dir", metavar="DIR", help="override runconfig.model_dir")
    parser.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a params value (repeatable)")


def runconfig_values(args):
    """The options that are shorthands for a runconfig key, as parsed (``params.check``'s ``values``: set
    after --set, so the shorthand wins)."""
    return {f"runconfig.{key}": getattr(args, key) for key in ("num_csx", "execution_strategy", "model_dir")
            if getattr(args, key, None) is not None}


def print_json_or_lines(obj, as_json):
    if as_json:
        print(json.dumps(obj, indent=2))
    else:
        width = max(map(len, obj), default=0) + 1
        for key, value in obj.items():
            print(f"{key:<{width}} {value}")
