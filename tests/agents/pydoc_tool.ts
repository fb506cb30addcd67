// opencode's custom tool `pydoc` (copied into .opencode/tool/ of the test's work folder):
// Python's own pydoc, the tool the built-in model learned to call.
import { tool } from "@opencode-ai/plugin"
import { execFileSync } from "node:child_process"

export default tool({
  description: "Show the Python documentation of a module, class or function",
  args: { name: tool.schema.string().describe("a dotted Python name, such as json.dumps") },
  async execute(args) {
    const python = process.env.OPENCODE_FERMOE_PYTHON || "python3"
    return execFileSync(python, ["-m", "pydoc", args.name], { encoding: "utf8" }).slice(0, 2000)
  },
})
